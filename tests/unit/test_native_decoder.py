"""The decoder's blocks in one native call (models/native_decoder.py, models/kernels/layer.cpp): bit for bit
the eager blocks' numbers in w4a8 for every block flavour (q/k/v biases, q/k norms, LayerNorm with GELU
and learned positions), for a prefill, a chain, a tree, a padded ragged batch, one live row of several
and the hidden states a draft reads, and the packed layout's runs (equal rows, padded short blocks, causal
prompts, a draft's levels appended to the scratch); unfit models run eagerly; a forced choice the model
cannot take is refused; the decoder is rebuilt when the weights may have moved."""
from __future__ import annotations

import pytest
import torch
from families import ALL_FAMILIES

from specstack.attention import build_batch, packed_append_batch, row_blocks_batch, tree_batch
from specstack.errors import SpecstackError
from specstack.models import native_decoder
from specstack.models.loading import load_model

native_only = pytest.mark.skipif(not native_decoder.native.supported("layer"),
                                 reason="the native kernels do not build on this CPU (no AVX2)")
CTX = [(7 * i + 3) % 250 for i in range(23)]
HIDDEN = (0, 1, 2)


def w4a8_model(tiny):
    return load_model(str(tiny.path), dtype="w4a8", use_cache=False, tokenizer=False).model


def forwards(model):
    """Logits and hidden states of several forwards, each over a fresh cache: a prefill of CTX (one row and
    three), then after it a chain of 4, a tree of 5, a padded ragged step of three rows, and one step of
    a row whose cache holds room for four; packed: ragged prompts over empty rows (causal runs), then
    rows of 6 tokens beside short blocks of 1, 4 and 2 (an equal run, a padded one), and one token a row
    with a draft's level of 2, none and 1 nodes appended to it."""
    out = []

    def run(cache, tokens, batch):
        o = model.forward(tokens, batch, cache, hidden_layers=HIDDEN)
        out.extend([o.logits, *o.hidden.values()])

    def prefilled(rows, max_rows=None):
        cache = model.new_cache(rows, 48, max_rows=max_rows)
        run(cache, torch.tensor([CTX] * rows), build_batch(cache, len(CTX)))
        cache.commit_prefix([len(CTX)] * rows)
        return cache

    cache = prefilled(1)
    run(cache, torch.tensor([CTX[:4]]), build_batch(cache, 4))
    run(cache, torch.tensor([CTX[4:9]]), tree_batch(cache, [-1, -1, 0, 0, 1]))
    cache = prefilled(3)
    parents = [[-1, 0, 1], [-1], [-1, 0]]
    run(cache, torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]]), row_blocks_batch(cache, parents, "pad"))
    cache = prefilled(1, max_rows=4)
    run(cache, torch.tensor([[11]]), build_batch(cache, 1))
    cache = model.new_cache(5, 48)
    chains = [list(range(-1, n - 1)) for n in (8, 7, 1, 3, 4)]
    batch = row_blocks_batch(cache, chains, "split")
    assert batch.runs is not None and [r.is_causal for r in batch.runs] == [True, True, False]
    run(cache, torch.tensor([CTX]), batch)
    cache.commit_prefix([len(c) for c in chains])
    parents = [[-1, 0, 1, 2, 3, 4], [-1, 0, 1, 2, 3, 4], [-1], [-1, 0, 0, 1], [-1, 0]]
    batch = row_blocks_batch(cache, parents, "split")
    assert batch.runs is not None and [(r.stop - r.start, r.gather is not None) for r in batch.runs] == [(2, False), (3, True)]
    run(cache, torch.tensor([CTX[2:21]]), batch)
    cache.commit_prefix([2, 6, 1, 2, 1])
    run(cache, torch.tensor([CTX[5:10]]), row_blocks_batch(cache, [[-1]] * 5, "split"))
    masks = [torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool), None, torch.tensor([[1, 1]], dtype=torch.bool),
             None, None]
    offsets = [torch.tensor([1, 1]), None, torch.tensor([1]), None, None]
    run(cache, torch.tensor([CTX[12:15]]), packed_append_batch(cache, masks, offsets))
    return out


@native_only
@pytest.mark.parametrize("arch", ALL_FAMILIES)
def test_the_native_blocks_compute_the_eager_blocks_numbers(monkeypatch, tiny_models, arch):
    model = w4a8_model(tiny_models[arch])
    monkeypatch.setenv(native_decoder.FORCE_ENV, "eager")
    eager = forwards(model)
    assert model._native is None
    monkeypatch.setenv(native_decoder.FORCE_ENV, "native")
    model._drop_native()
    native = forwards(model)
    assert model._native is not None
    assert len(native) == len(eager)
    for i, (a, b) in enumerate(zip(native, eager, strict=True)):
        assert torch.equal(a, b), f"output {i} differs from the eager blocks'"


@native_only
def test_it_is_the_default_for_both_layouts(monkeypatch, tiny_llama):
    monkeypatch.delenv(native_decoder.FORCE_ENV, raising=False)
    model = w4a8_model(tiny_llama)
    cache = model.new_cache(2, 48)
    model.forward(torch.tensor([CTX] * 2), build_batch(cache, len(CTX)), cache)
    assert model._native is not None, "w4a8 on a native path takes the native decoder unforced"
    cache.commit_prefix([len(CTX)] * 2)
    parents = [[-1, 0, 1], [-1]]
    batch = row_blocks_batch(cache, parents, "split")
    assert batch.runs is not None
    calls = []
    real = native_decoder.NativeDecoder.forward
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    split = model.forward(torch.tensor([[5, 6, 7, 8]]), batch, cache).logits
    assert calls == [1], "a packed block runs natively"
    pad = model.forward(torch.tensor([[5, 6, 7], [8, 0, 0]]), row_blocks_batch(cache, parents, "pad"), cache).logits
    assert calls == [1, 1], "a padded block runs natively"
    assert torch.equal(split[0, :3], pad[0]) and torch.equal(split[0, 3], pad[1, 0])


@native_only
def test_unfit_models_run_eagerly_and_a_forced_native_one_is_refused(monkeypatch, tiny_llama):
    monkeypatch.delenv(native_decoder.FORCE_ENV, raising=False)
    model = tiny_llama.lm.model  # fp32: not batch-invariant
    assert native_decoder.unfit(model) is not None and native_decoder.native_decoder(model) is None
    monkeypatch.setenv(native_decoder.FORCE_ENV, "native")
    with pytest.raises(SpecstackError, match="SPECSTACK_DECODER=native: fp32 is not a batch-invariant format"):
        native_decoder.native_decoder(model)
    monkeypatch.setenv(native_decoder.FORCE_ENV, "fast")
    with pytest.raises(SpecstackError, match="choose from native, eager"):
        native_decoder.native_decoder(w4a8_model(tiny_llama))


@native_only
def test_the_decoder_is_dropped_when_the_weights_may_move(monkeypatch, tiny_llama):
    monkeypatch.delenv(native_decoder.FORCE_ENV, raising=False)
    model = w4a8_model(tiny_llama)
    cache = model.new_cache(1, 48)
    model.forward(torch.tensor([CTX]), build_batch(cache, len(CTX)), cache)
    built = model._native
    assert built is not None
    model.to(torch.device("cpu"))  # nn.Module._apply: the tensors may be new ones
    assert model._native is None and not model._native_chosen
    model.load_state_dict(model.state_dict())
    assert model._native is None
    cache = model.new_cache(1, 48)
    model.forward(torch.tensor([CTX]), build_batch(cache, len(CTX)), cache)
    assert model._native is not None and model._native is not built
