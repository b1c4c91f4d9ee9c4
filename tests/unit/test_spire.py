"""The SPIRe draft model (specstack.models.spire_draft): sliding window, feedback memory, pruned initialisation,
target activations, the training forward agreeing with what the engine runs, distillation, storage."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_checkpoints import llama

from specstack.attention import AttentionBatch, build_batch, causal_block_mask
from specstack.config import WindowSpec
from specstack.errors import SpecstackError
from specstack.models.base import DecoderModel, ReadsTargetActivations
from specstack.models.draft_file import load_draft_file, save_draft
from specstack.models.loading import load_model
from specstack.models.spire_draft import SpireDraft, UnrolledKeys
from specstack.training.distill import (
    TrainParams,
    acceptance,
    draft_index,
    train,
    train_loss,
)
from specstack.training.prune import build_draft
from specstack.training.teacher import (
    CachedTeacher,
    TeacherSpec,
    build_cache,
    iter_batches,
    shard_paths,
)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(tmp_path_factory, request):
    """A tiny Llama (3 blocks, V = 257) in fp32, and the same shape as Qwen2 (q/k/v biases, drawn as widely
    as the weights: a draft that dropped them would not reproduce the blocks it copies)."""
    path = tmp_path_factory.mktemp("spire") / "t"
    spec = llama(seed=21, vocab=257, layers=3, hidden=64, max_pos=128, init=0.15)
    if request.param == "qwen2":
        spec = dataclasses.replace(spec, family="qwen2", rope_theta=1e6)
    spec.save(path)
    lm = load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False)
    assert lm.config.block.qkv_bias == (request.param == "qwen2")
    return lm


def target_logits_and_hidden(target, tokens, layers=()):
    cache = target.model.new_cache(1, tokens.shape[1])
    out = target.model.forward(tokens, build_batch(cache, tokens.shape[1]), cache, hidden_layers=layers)
    hidden = torch.stack([out.hidden[i] for i in layers], 2) if layers else None
    return out.logits, hidden


def randomise_mix(draft, seed=0):
    """Random memory mixes (and feature-input projection, which starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in draft.layers:
            blk.mix.copy_(torch.randn(blk.mix.shape, generator=g))
        if draft.spire.feature_input:
            draft.fuse.weight.copy_(0.1 * torch.randn(draft.fuse.weight.shape, generator=g))


def tokens_of(n, seed=0):
    return torch.randint(0, 257, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_one_by_one(draft, tokens):
    """The engine's path for a plain decoder: one token per forward, committed (window evicts)."""
    cache = draft.new_cache(1, tokens.shape[1] + 4)
    rows = [draft.extend(tokens[:, t:t + 1], cache).logits[0, 0] for t in range(tokens.shape[1])]
    return torch.stack(rows), cache


def test_a_spire_draft_is_a_decoder_model_that_reads_target_activations(target):
    """The typed seams (models/base.py): the draft and the target are decoders with the same
    surface; only the draft reads the target's activations; its cache keeps its trained window."""
    window = WindowSpec(sink=1, window=6)
    draft = build_draft(target.model, 2, keep=[1, 2], window=window)
    assert isinstance(draft, DecoderModel) and isinstance(target.model, DecoderModel)
    assert isinstance(draft, ReadsTargetActivations) and not isinstance(target.model, ReadsTargetActivations)
    assert draft.new_cache(1, 16).window == window == draft.new_cache(1, 16, window).window
    with pytest.raises(SpecstackError, match="trained with the window"):
        draft.new_cache(1, 16, WindowSpec(sink=1, window=3))


def test_extend_over_a_block_equals_one_token_at_a_time(target):
    """A plain-decoder draft's extend (a prefill block, committed) leaves the cache one-by-one decoding
    leaves: the logits of the tokens after it agree."""
    tokens = tokens_of(30, seed=6)
    draft = build_draft(target.model, 2, keep=[1, 2], window=WindowSpec(sink=1, window=6), feedback=False,
                        target_acts=False)
    one_by_one, _ = decode_one_by_one(draft, tokens)
    cache = draft.new_cache(1, 34)
    prefill = draft.extend(tokens[:, :20], cache).logits[0]
    rest = torch.cat([draft.extend(tokens[:, t:t + 1], cache).logits[0] for t in range(20, 30)])
    torch.testing.assert_close(torch.cat([prefill, rest]), one_by_one, atol=1e-4, rtol=1e-4)


def test_sliding_window_equals_full_attention_masked_to_the_window(target):
    """Decoding with a windowed cache that physically evicts old slots gives the logits of full
    attention masked to sink + window; and the window changes them (it is really applied)."""
    window = WindowSpec(sink=1, window=6)
    tokens = tokens_of(40)
    windowed = build_draft(target.model, 2, keep=[1, 2], window=window, feedback=False, target_acts=False)
    decoded, cache = decode_one_by_one(windowed, tokens)
    assert cache.lengths[0] < 40  # slots were evicted
    masked = windowed.train_forward(tokens, None, 1)[0][0]
    full = build_draft(target.model, 2, keep=[1, 2], window=None, feedback=False, target_acts=False)
    unmasked = full.train_forward(tokens, None, 1)[0][0]
    torch.testing.assert_close(decoded, masked, atol=1e-4, rtol=1e-4)
    assert torch.allclose(decoded[:7], unmasked[:7], atol=1e-4)  # within the window: no difference
    assert (decoded[10:] - unmasked[10:]).abs().max() > 1e-2


def test_feedback_with_one_hot_mix_reproduces_a_plain_decoder(target):
    """Memories mixed one-hot on each block's own input, fed the target's own activations, with all
    the target's blocks: every unrolled draft step is exactly the target (plain decoder)."""
    tokens = tokens_of(30, seed=1)
    draft = build_draft(target.model, 3, keep=[0, 1, 2], window=None, feedback=True, target_acts=True)
    with torch.no_grad():
        for i, blk in enumerate(draft.layers):
            blk.mix.fill_(-1e4)
            blk.mix[i] = 0.0
    ref, hidden = target_logits_and_hidden(target, tokens, draft.target_hidden_layers)
    for step in draft.train_forward(tokens, hidden, 3):
        torch.testing.assert_close(step, ref, atol=1e-4, rtol=1e-4)
    randomise_mix(draft)  # and a real mix is no longer the plain decoder
    assert (draft.train_forward(tokens, hidden, 1)[0] - ref).abs().max() > 1e-2


def test_pruned_initialisation_copies_exactly_the_chosen_blocks(target):
    """Each draft block holds its target block's tensors and, being a transformer.Block over trainable
    parts (nn.Linear, norms with gradients), computes exactly what that block computes."""
    draft = build_draft(target.model, 2, keep=[2, 0], window=None)
    assert all(p.requires_grad for p in draft.parameters())  # the norms train too
    b, t = 2, 6
    pos = torch.arange(t).expand(b, t)
    batch = AttentionBatch(pos, causal_block_mask(t)[None, None], (t,) * b)
    rope = (target.model.rope_cos[pos].unsqueeze(2), target.model.rope_signed_sin[pos].unsqueeze(2))
    x = torch.randn(b * t, target.config.d_model, generator=torch.Generator().manual_seed(7))
    for blk, k in zip(draft.layers, [2, 0], strict=True):
        src = target.model.layers[k]
        for name in ("qkv", "o", "up", "down"):
            assert torch.equal(getattr(blk, name).weight, getattr(src, name).weight)
        if target.config.block.qkv_bias:
            assert blk.qkv.bias is not None and torch.equal(blk.qkv.bias, src.qkv.bias)
            assert blk.qkv.bias.abs().max() > 0.01  # the tiny qwen2's biases are drawn, not zero
        else:
            assert blk.qkv.bias is None
        assert torch.equal(blk.attn_norm.weight, src.attn_norm.weight)
        assert torch.equal(blk.mlp_norm.weight, src.mlp_norm.weight)
        with torch.no_grad():  # a block's own keys only (UnrolledKeys(): no memories before them)
            assert torch.equal(blk.forward(x, rope, batch, UnrolledKeys()), src.forward(x, rope, batch, UnrolledKeys()))
    assert torch.equal(draft.norm, target.model.norm.weight)
    assert draft.embed.data_ptr() == target.model.embed.data_ptr()  # shared, not copied
    assert torch.equal(draft.head, target.model.head.weight)  # untied target: its unembedding
    assert draft.target_hidden_layers == (3, 1)  # reads the target after the blocks it copies
    other = build_draft(target.model, 2, keep=None, window=None)
    assert not torch.equal(other.layers[0].qkv.weight, draft.layers[0].qkv.weight)


@pytest.mark.parametrize("window", [None, WindowSpec(1, 5)])
@pytest.mark.parametrize("feature_input", [False, True])
def test_training_forward_matches_what_the_engine_runs(target, window, feature_input):
    """Step j of train_forward at position t equals the engine's path: the target's memories of the
    tokens before t - j + 1 written from its activations, then j draft forwards, each appended (with
    feature input, each reading the feature its predecessor left in the cache)."""
    tokens = tokens_of(24, seed=2)
    draft = build_draft(target.model, 2, keep=[1, 2], window=window,
                        vocab_ids=torch.arange(0, 257, 2), feature_input=feature_input)
    randomise_mix(draft, seed=3)
    _, hidden = target_logits_and_hidden(target, tokens, draft.target_hidden_layers)
    steps = draft.train_forward(tokens, hidden, 3)
    for t0 in (0, 5, 13, 20):
        cache = draft.new_cache(1, 40)
        if t0:
            draft.write_memories(tokens[:, :t0], hidden[:, :t0], cache)
        for j in range(3):
            t = t0 + j
            batch = build_batch(cache, 1, append=j > 0)
            out = draft.forward(tokens[:, t:t + 1], batch, cache)
            assert out.vocab_ids is draft.vocab_ids  # its columns are the reduced vocabulary
            torch.testing.assert_close(out.logits[0, 0], steps[j][0, t], atol=1e-4, rtol=1e-4)


def test_a_few_training_steps_reduce_the_loss_and_raise_acceptance(target, tmp_path):
    """Distillation from the cached teacher on the tiny target's own sampled text: the loss on a fixed
    batch falls and the greedy acceptance measured on that text rises (a random tiny target has no
    structure to generalise from in 20 sequences: held-out acceptance is for the real model)."""
    seqs = []
    for s in range(20):  # text the target likes: its own samples (low temperature)
        g = torch.Generator().manual_seed(s)
        cache = target.model.new_cache(1, 48)
        tok = torch.randint(0, 257, (1, 1), generator=g)
        out = [int(tok)]
        for _ in range(47):
            logits = target.model.forward(tok, build_batch(cache, 1), cache).logits[0, -1]
            cache.commit_all()
            tok = torch.multinomial(torch.softmax(logits / 0.3, -1), 1, generator=g).view(1, 1)
            out.append(int(tok))
        seqs.append(out)
    draft = build_draft(target.model, 1, keep=[2], window=WindowSpec(1, 16))
    spec = TeacherSpec(layers=(1, 2, 3), topk=16, shard_size=8)  # more layers than the draft reads
    build_cache(target.model, torch.tensor(seqs), tmp_path / "train", spec, "train")
    paths = shard_paths(tmp_path / "train")
    params = TrainParams(steps=100, batch_size=4, lr=3e-3, warmup=5, draft_steps=2, eval_every=100,
                         eval_sequences=4, eval_k=3, checkpoint_every=100)
    batch = next(iter_batches(paths, 8))
    index = draft_index(draft)
    with torch.no_grad():
        loss_before = float(train_loss(draft, batch, index, params))
    before = acceptance(draft, iter_batches(paths, 1), 3, 20)
    train(draft, CachedTeacher(paths, paths[:1]), params, tmp_path, log=lambda msg: None)
    with torch.no_grad():
        loss_after = float(train_loss(draft, batch, index, params))
    after = acceptance(draft, iter_batches(paths, 1), 3, 20)
    assert loss_after < loss_before - 0.05
    assert after.alpha[0] > before.alpha[0] + 0.15 and after.tau > before.tau + 0.15
    assert (tmp_path / "checkpoint.pt").is_file()


def test_save_and_load_round_trip(target, tmp_path):
    draft = build_draft(target.model, 2, keep=[0, 2], window=WindowSpec(1, 8), vocab_ids=torch.arange(100, 257))
    randomise_mix(draft, seed=4)
    with torch.no_grad():  # the file holds bf16: make the weights bf16-exact to compare exactly
        for p in draft.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    path = tmp_path / "d.safetensors"
    save_draft(draft, path, {"target": "tiny"})
    loaded = load_draft_file(path, target, "fp32").model
    assert loaded.spire == draft.spire and torch.equal(loaded.vocab_ids, draft.vocab_ids)
    tokens = tokens_of(20, seed=5)
    _, hidden = target_logits_and_hidden(target, tokens, draft.target_hidden_layers)
    for a, b in zip(loaded.train_forward(tokens, hidden, 2), draft.train_forward(tokens, hidden, 2), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert path.stat().st_size < 2 * sum(p.numel() for p in draft.parameters()) + 4096  # no embeddings inside
    with pytest.raises(SpecstackError, match="unsupported draft weight format 'fp16'"):
        load_draft_file(path, target, "fp16")
    with pytest.raises(SpecstackError, match="unsupported draft weight format"):  # checked before the file
        load_draft_file(tmp_path / "missing.safetensors", target, "q4")


def test_the_shipped_draft_loads_and_is_described_for_the_throughput_model():
    """The default draft file: small, loadable for the embedded model, and its shape (2 blocks, its own
    8192-row unembedding, sink + window positions, bf16) is what `specstack throughput` costs."""
    from specstack.models.draft_file import draft_info
    from specstack.models.registry import default_draft_path
    from specstack.throughput.shapes import draft_shape, model_shape

    path = default_draft_path("smollm2-135m")
    assert path is not None and path.stat().st_size < 25 * 2**20
    info = draft_info(path)
    assert "train-draft" in info["command"] and info["target"] == "smollm2-135m"
    target = model_shape("smollm2-135m", "int4")
    shape = draft_shape("default", target, "int4")
    assert (shape.n_layers, shape.d_model, shape.fmt) == (2, target.d_model, "bf16")
    assert shape.head_params == 8192 * target.d_model and shape.window == 257
    assert shape.body_params == target.body_params * 2 // target.n_layers


def test_draft_files_keep_their_tensor_names():
    """A draft block's norms are modules ("layers.0.attn_norm.weight"), yet drafts are written and read
    under the names draft files have always had ("layers.0.attn_norm"): the shipped draft reads strictly
    and writes back under its own names; a state dict under the modules' names reads too."""
    from safetensors.torch import load_file

    from specstack.models.draft_file import read_draft_header
    from specstack.models.registry import default_draft_path

    path = default_draft_path("smollm2-135m")
    assert path is not None
    config = read_draft_header(path).config
    stored = load_file(str(path))
    draft = SpireDraft(config, stored["vocab_ids"])
    draft.load_state_dict(stored, strict=True)
    assert set(draft.state_dict()) == set(stored) and "layers.1.mlp_norm" in stored
    assert torch.equal(draft.layers[1].mlp_norm.weight, stored["layers.1.mlp_norm"].float())
    own = dict(draft.named_parameters()) | {"vocab_ids": draft.vocab_ids}
    assert "layers.1.mlp_norm.weight" in own
    again = SpireDraft(config, stored["vocab_ids"])
    again.load_state_dict(own, strict=True)
    assert torch.equal(again.layers[1].mlp_norm.weight, draft.layers[1].mlp_norm.weight)


def test_online_teacher_gives_the_cached_teachers_batches(target, tmp_path):
    """The teacher run on each batch (the GPU path) yields exactly what the disk cache holds for the
    same sequences, and a resumed run's `skip` passes over batches without changing the order."""
    from specstack.training.teacher import OnlineTeacher

    seqs = torch.randint(0, 257, (6, 24), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    spec = TeacherSpec(layers=(2, 3), topk=8, shard_size=4)
    build_cache(target.model, seqs, tmp_path / "held", spec, "held-out")
    online = OnlineTeacher(target.model, seqs, seqs, spec)
    cached = list(iter_batches(shard_paths(tmp_path / "held"), 1))
    by_first = {int(b["tokens"][0, 0]): b for b in cached}  # the cache shuffles; match by sequence
    for got in online.heldout_batches():
        want = by_first[int(got["tokens"][0, 0])]
        for key in ("tokens", "topk_ids", "topk_logp", "hidden", "layers"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
        assert not got["hidden"].is_inference()  # autograd may save it
    full = online.train_batches(2, seed=5)
    firsts = [next(full)["tokens"] for _ in range(5)]  # 3 batches per epoch: crosses an epoch
    resumed = online.train_batches(2, seed=5, skip=3)
    torch.testing.assert_close(next(resumed)["tokens"], firsts[3])


def test_chain_counts_by_hand():
    """alpha_j = accepted / eligible at step j; a chain is eligible for step j only where steps < j were
    accepted and the text followed the target's greedy tokens; context buckets (C/2, C]."""
    from specstack.training.distill import ChainCounts

    text = torch.tensor([5, 1, 2, 3, 4, 9, 9, 9])
    greedy = torch.tensor([1, 2, 3, 4, 7, 9, 9, 9])  # the target's next token after each position
    g1 = torch.tensor([1, 2, 0, 4, 7, 0, 9, 0])  # step-1 guesses: right at 0, 1, 3, 4, 6
    g2 = greedy.clone()  # step 2 always right
    counts = ChainCounts(2, contexts=(2, 6))
    counts.add(text, greedy, [g1, g2])
    acc = counts.result()
    # starts t0 = 0..5: step 1 right at 0, 1, 3, 4 (5/6 wrong at 5? g1[5] = 0 != 9): 4 of 6
    # step 2 (query text[t0 + 1] must equal greedy[t0]): t0 = 0 (1 == 1), 1 (2 == 2), 3 (4 == 4),
    # 4 (9 != 7: not eligible) -> 3 eligible, all right
    assert acc.alpha == pytest.approx([4 / 6, 3 / 3])
    assert acc.tau == pytest.approx(1 + 4 / 6 + 4 / 6)
    # context (1, 2]: t0 = 1 only (2 tokens seen); (3, 6]: t0 = 3, 4, 5
    assert acc.by_context[2].alpha == pytest.approx([1.0, 1.0])
    assert acc.by_context[6].alpha == pytest.approx([2 / 3, 1.0])
    # the walk: accepted runs per start are 2, 2, 0, 2, 1, 0; rounds start at t0 = 0 (3 tokens), then
    # t0 = 3 (3 tokens), then 6 is past the last start: 6 tokens in 2 rounds
    assert acc.walk_tau == 3.0
    assert acc.by_context[2].walk_tau is None and acc.by_context[6].walk_tau == 3.0


def greedy_texts(target, n: int = 3, length: int = 40) -> torch.Tensor:
    """The target's own greedy text after random starts: every chain is eligible."""
    seqs = []
    for s in range(n):
        cache = target.model.new_cache(1, length + 8)
        tok = torch.randint(0, 257, (1, 4), generator=torch.Generator().manual_seed(s))
        out = tok[0].tolist()
        while len(out) < length:
            logits = target.model.forward(tok, build_batch(cache, tok.shape[1]), cache).logits[0, -1]
            cache.commit_all()
            tok = logits.argmax().view(1, 1)
            out.append(int(tok))
        seqs.append(out)
    return torch.tensor(seqs, dtype=torch.int32)


def test_model_acceptance_of_the_target_itself_is_one_and_a_cut_head_lowers_it(target, tmp_path):
    """A draft model with its full context, teacher-forced: the target drafting for itself guesses every
    token (a guess read one position off would miss); with its head over 8 tokens it misses the rest."""
    from specstack.training.acceptance import load_model_design, model_acceptance
    from specstack.training.teacher import OnlineTeacher

    seqs = greedy_texts(target)
    teacher = OnlineTeacher(target.model, seqs[:0], seqs, TeacherSpec(layers=()))
    full = model_acceptance(target.model, teacher, 3, (20, 40))
    assert full.alpha == [1.0, 1.0, 1.0] and full.by_context[40].alpha == [1.0, 1.0, 1.0]
    cut = model_acceptance(target.model.with_head_over(torch.arange(8)), teacher, 3, (20, 40))
    assert cut.alpha[0] < 0.9
    other = tmp_path / "other"
    llama(seed=3, vocab=300, layers=1, hidden=64, max_pos=128, init=0.15).save(other)
    with pytest.raises(SpecstackError, match="its vocabulary \\(300 tokens\\) is not the target's \\(257\\)"):
        load_model_design(str(other), target, "cpu")
    with pytest.raises(SpecstackError, match="no token ranking ships"):
        load_model_design(f"{target.source}@8", target, "cpu")  # a tiny model has no ranking


def test_magicdec_acceptance_is_one_with_a_window_wider_than_the_text(target):
    """MagicDec teacher-forced: with a window covering every position the windowed target is the target
    (every guess accepted); a window of 2 loses context and is rejected somewhere."""
    from specstack.training.acceptance import magicdec_acceptance
    from specstack.training.teacher import OnlineTeacher

    seqs = greedy_texts(target)
    teacher = OnlineTeacher(target.model, seqs[:0], seqs, TeacherSpec(layers=()))
    wide = magicdec_acceptance(target.model, teacher, 3, (20, 40), fixed=64)
    assert wide.alpha == [1.0, 1.0, 1.0] and wide.by_context[40].alpha == [1.0, 1.0, 1.0]
    narrow = magicdec_acceptance(target.model, teacher, 3, (20, 40), fixed=2)
    assert narrow.alpha[0] < 0.9
    per_context = magicdec_acceptance(target.model, teacher, 3, (16, 40), fixed=None)  # windows 2 and 5
    assert per_context.alpha == [] and set(per_context.by_context) == {16, 40}


def test_sequences_file_round_trip_and_errors(tmp_path):
    from specstack.errors import SpecstackError
    from specstack.training.data import load_sequences, save_sequences

    train_s = torch.randint(0, 49152, (5, 16), dtype=torch.int32)
    held = torch.randint(0, 49152, (2, 16), dtype=torch.int32)
    path = tmp_path / "seq.safetensors"
    save_sequences(path, train_s, held, {"data": "code:1"})
    got_t, got_h = load_sequences(path, 16, 4, 2)
    assert got_t.dtype == torch.int32 and torch.equal(got_t, train_s[:4]) and torch.equal(got_h, held)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:  # stored as uint16: half the bytes to move
        assert f.get_slice("train").get_dtype() == "U16"
    with pytest.raises(SpecstackError, match="sequences of 16 tokens, --seq-len is 32"):
        load_sequences(path, 32, 4, 2)
    with pytest.raises(SpecstackError, match="5 training and 2 held-out"):
        load_sequences(path, 16, 6, 2)
    (tmp_path / "x.safetensors").write_text("not safetensors")
    with pytest.raises(SpecstackError, match="cannot read sequences"):
        load_sequences(tmp_path / "x.safetensors", 16, 1, 1)


def test_an_int8_draft_computes_with_its_quantised_weights(target, tmp_path):
    """Loaded as int8 (the default for trained drafts), every linear and the unembedding run the int8
    kernel; the draft then computes what the same draft with those dequantised weights computes, and
    differs from the unquantised draft by the quantisation only (fp32 activations, so that bf16
    rounding does not blur the comparison)."""
    draft = build_draft(target.model, 2, keep=[0, 2], window=WindowSpec(1, 8), vocab_ids=torch.arange(100, 257),
                        feature_input=True)
    randomise_mix(draft, seed=6)
    path = tmp_path / "d.safetensors"
    save_draft(draft, path, {"target": "tiny"})
    loaded = load_draft_file(path, target, "int8")
    assert loaded.fmt == "int8" and loaded.model.head_q.fmt == "int8" and loaded.model.norm.dtype == torch.bfloat16
    small = load_draft_file(path, target, "fp32").model.quantize_("int8")
    plain = load_draft_file(path, target, "fp32").model
    same = load_draft_file(path, target, "fp32").model  # will get small's dequantised weights
    linears = [(getattr(bs, n), getattr(bp, n)) for bs, bp in zip(small.layers, same.layers, strict=True)
               for n in ("qkv", "o", "up", "down")] + [(small.fuse, same.fuse)]
    assert all(q.fmt == "int8" for q, _ in linears)
    with torch.no_grad():
        for q, lin in linears:
            lin.weight.copy_(q.dequantized())
        same.head = small.head_q.dequantized()

    tokens = tokens_of(20, seed=7)
    _, hidden = target_logits_and_hidden(target, tokens, draft.target_hidden_layers)

    def run(model, width):  # 8 verified tokens from the target's activations, then 12 more in blocks
        cache = model.new_cache(1, 24)
        model.write_memories(tokens[:, :8], hidden[:, :8], cache)
        return torch.cat([model.forward(tokens[:, i:i + width], build_batch(cache, width, append=i > 8), cache).logits
                          for i in range(8, 20, width)], 1)

    for width in (1, 12):  # the int8 kernel, and (from wide_rows on) the dense copy
        out_small, out_same, out_plain = run(small, width), run(same, width), run(plain, width)
        quant_err = (out_small - out_plain).abs().max()
        assert quant_err > 1e-3  # the weights really are quantised
        assert (out_small - out_same).abs().max() < 1e-2 * quant_err


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantised_drafts_memory_projection_is_exactly_the_kv_rows_of_its_qkv(target, fmt):
    """Memories need keys and values only: a quantised draft projects them with its own copy of qkv's
    k/v rows. The formats quantise each row on its own, so the copy must give exactly the k/v columns
    of the full projection, at one row (the small format's kernel) and wide (the dense copy)."""
    draft = build_draft(target.model, 2, keep=[0, 2], window=WindowSpec(1, 8))
    draft = draft.to(torch.bfloat16).quantize_(fmt)
    q_dim = draft.config.q_dim
    for rows in (1, 12):
        h = torch.randn(1, rows, draft.config.d_model, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for blk in draft.layers:
            assert blk.kv.fmt == fmt
            assert torch.equal(blk.kv_proj(h), blk.qkv(h)[..., q_dim:])
