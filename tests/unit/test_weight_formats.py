"""The weight-format table (specstack/weight_formats.py) and its methods (models/linear_methods.py): every
row's stated bytes are what a layer of it reads, its stated activation is what its layers compute in,
and a new format is one row and one method class: a toy format built here, through the table alone,
runs as a layer and as a whole model."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specstack.config import GenerationConfig
from specstack.engine.batched import generate
from specstack.errors import SpecstackError
from specstack.models.bound import Forward
from specstack.models.linear_methods import LinearMethod, method_for
from specstack.models.loading import load_model
from specstack.models.quant import QLinear
from specstack.throughput.shapes import KV_BYTES, WEIGHT_BYTES
from specstack.weight_formats import FORMATS, WEIGHT_FORMATS, WeightFormat, requested_format, weight_format


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_row_states_what_its_layers_read_and_compute_in(name):
    spec = FORMATS[name]
    n, k = 256, 512
    lin = QLinear(k, n, name).set_float(rand(n, k, seed=1) * 0.05)
    assert isinstance(lin.method, LinearMethod) and lin.method.spec is spec
    # per-row scales are the only bytes a row of the table leaves out (k inputs share one)
    assert abs(lin.step_bytes() / (n * k) - spec.bytes_per_weight) <= 4 / k, name
    x = rand(3, k, seed=2).to(lin.act_dtype)
    y = lin(x)
    assert y.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.activation]
    # a dense copy for wide inputs is resident beside the codes, and counted there only
    copy = 0 if lin.dense is None else lin.dense.nbytes
    assert (lin.dense is not None) == (spec.wide_rows is not None)
    assert lin.resident_bytes() >= lin.step_bytes() + copy
    # the float weight the format stands for is what its kernel multiplies by, up to the activations'
    # rounding: bf16's, or the 8-bit codes of the batch-invariant formats
    ref = F.linear(x.float(), lin.float_weight().float())
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err <= (2e-2 if spec.batch_invariant or spec.activation == "bf16" else 1e-5), (name, err)


def test_the_readers_follow_the_table():
    assert set(WEIGHT_FORMATS) == {f.name for f in FORMATS.values() if f.requested}
    for f in FORMATS.values():
        assert WEIGHT_BYTES[f.name] == f.bytes_per_weight and KV_BYTES[f.name] == f.kv_bytes
        assert f.head is None or f.head in FORMATS
        assert f.whole_only is None or f.whole_only in FORMATS
        if f.batch_invariant:  # their rows' numbers are fp32 all through (DESIGN §3)
            assert f.activation == "fp32" and f.cpu_only
    with pytest.raises(SpecstackError, match="unsupported weight format 'fp8'; choose from int4, w4a8"):
        weight_format("fp8")
    with pytest.raises(SpecstackError, match="unsupported dtype 'k4a8'"):  # a layer format is never asked for
        requested_format("k4a8", "dtype")


class Half(LinearMethod):
    """A toy format: the weight in fp16, fp32 activations (what a new format's method looks like)."""

    def create(self, layer, n, k, device):
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.float16, device=device))

    def set_float(self, layer, w):
        layer.weight.copy_(w)

    def kernel(self, layer) -> Forward:
        w = layer.weight
        return lambda x: F.linear(x, w.float())

    def float_weight(self, layer):
        return layer.weight.float()


@pytest.fixture
def half_format(monkeypatch):
    row = WeightFormat("half", f"{__name__}:Half", 2.0, "fp32", "fp16 floats, fp32 activations")
    monkeypatch.setitem(FORMATS, "half", row)  # type: ignore[index]
    method_for.cache_clear()
    yield row
    method_for.cache_clear()


def test_a_new_format_is_one_row_and_one_method(half_format, tiny_llama):
    lin = QLinear(64, 48, "half", bias=True).set_float(w := rand(48, 64, seed=3), b := rand(48, seed=4))
    assert isinstance(lin.method, Half) and lin.step_bytes() == 48 * 64 * 2 + 48 * 4
    x = rand(5, 64, seed=5)
    assert torch.equal(lin(x), F.linear(x, w.half().float(), b))
    # a whole model in it, loaded from a checkpoint through the same loader as every format
    lm = load_model(str(tiny_llama.path), dtype="half", use_cache=False, tokenizer=False)
    layers = [m for m in lm.model.modules() if isinstance(m, QLinear)]
    assert layers and {m.fmt for m in layers} == {"half"}
    ref = {id(m): m for m in tiny_llama.lm.model.modules() if isinstance(m, QLinear)}
    assert len(ref) == len(layers)
    for mine, theirs in zip(layers, (m for m in tiny_llama.lm.model.modules() if isinstance(m, QLinear)), strict=True):
        assert torch.equal(mine.float_weight(), theirs.float_weight().half().float())
    prompt = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    mine_logits = lm.model.extend(prompt, lm.model.new_cache(1)).logits
    want = tiny_llama.lm.model.extend(prompt, tiny_llama.lm.model.new_cache(1)).logits
    torch.testing.assert_close(mine_logits, want, atol=2e-2, rtol=0)  # fp16 weights: ~1e-3 of each
    assert len(generate(lm, prompt[0].tolist(), GenerationConfig(max_new_tokens=12, stop_on_eos=False)).tokens) == 12
    # a row the table does not ask for is refused where a model is asked for
    FORMATS["half"] = replace(half_format, requested=False)  # type: ignore[index]
    with pytest.raises(SpecstackError, match="unsupported dtype 'half'"):
        load_model(str(tiny_llama.path), dtype="half", use_cache=False, tokenizer=False)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_cache_stores_what_any_cpu_loads_and_a_load_derives_the_rest(fmt, tiny_llama, tmp_path, monkeypatch):
    """int4's codes are stored as w4a8_codes.pack_codes lays them out (torch's CPU layout follows the CPU's vector
    width) and repacked at load; neither format stores its dense copy, which a load derives exactly."""
    from safetensors.torch import load_file

    from specstack.models import w4a8_codes
    from specstack.models.dense_copy_methods import unpack_int4

    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    built = load_model(str(tiny_llama.path), dtype=fmt, tokenizer=False).model
    loaded = load_model(str(tiny_llama.path), dtype=fmt, tokenizer=False).model  # from the cache
    (file,) = tmp_path.rglob(f"{fmt}.r{FORMATS[fmt].revision}-cpu.safetensors")
    stored = load_file(str(file))
    assert not any(k.endswith(".dense") for k in stored)
    pairs = [(n, m, dict(loaded.named_modules())[n]) for n, m in built.named_modules() if isinstance(m, QLinear)]
    assert {m.fmt for _, m, _ in pairs} >= {fmt}
    for name, a, b in pairs:
        if a.fmt == "int4":
            assert torch.equal(stored[name + ".weight"], w4a8_codes.pack_codes(unpack_int4(a.weight)))
        assert torch.equal(a.weight, b.weight) and a.dense is not None and b.dense is not None
        assert torch.equal(a.dense, b.dense)
    prompt = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 120, 3, 9, 11, 200]])  # wide enough for the dense copy
    assert torch.equal(built.extend(prompt, built.new_cache(1)).logits, loaded.extend(prompt, loaded.new_cache(1)).logits)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_layer_over_some_of_its_rows_keeps_their_codes(name):
    """QLinear.take_rows (FR-Spec's restricted head): the chosen outputs' very codes and scales, so their
    float weights are the same and, in the batch-invariant formats, so is every output bit for bit."""
    n, k = 96, 512
    lin = QLinear(k, n, name, bias=True).set_float(rand(n, k, seed=6) * 0.05, rand(n, seed=7))
    rows = torch.tensor([90, 3, 4, 57, 0, 31, 17])  # unsorted, fewer than int4's 16-row padding
    cut = lin.take_rows(rows)
    assert cut.fmt == name and cut.out_features == len(rows) and cut.wide_rows == lin.wide_rows
    assert torch.equal(cut.float_weight(), lin.float_weight().index_select(0, rows))
    assert torch.equal(cut.bias, lin.bias.index_select(0, rows))
    x = rand(5, k, seed=8).to(lin.act_dtype)
    if FORMATS[name].batch_invariant:  # elsewhere a GEMM of another width may block its sums otherwise
        assert torch.equal(cut(x), lin(x).index_select(1, rows))
