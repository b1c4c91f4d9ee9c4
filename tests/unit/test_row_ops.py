"""A block's row operations (models/row_ops.py, models/kernels/layer.cpp): the native loops compute what
torch's composites compute (the rotation bit for bit, RMSNorm and SiLU within float rounding), every row
on its own whatever rows share the call (the parallel split included); a model with the fixed-order
attention computes its blocks' rows with them, any other model with torch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specstack.models import native
from specstack.models.loading import load_model
from specstack.models.row_ops import NATIVE, TORCH

native_only = pytest.mark.skipif(not native.supported("layer"),
                                 reason="the native kernels do not build on this CPU (no AVX2)")


@pytest.fixture(autouse=True)
def layer_library():
    """The ops registered (row_ops loads the library at its first native call; some tests call the ops
    directly first)."""
    if native.supported("layer"):
        assert native.load("layer")


def composite_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps).float() * w


def rope_inputs(b: int, t: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    angles = torch.rand(b, t, 1, d // 2, generator=g) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    signed_sin = torch.cat([-emb[..., : d // 2].sin(), emb[..., d // 2 :].sin()], dim=-1)
    # x as the block sees it: a view of wider rows (its heads not contiguous)
    wide = torch.randn(b, t, h + 2, d, generator=g)
    return wide[:, :, :h], emb.cos(), signed_sin


@native_only
@pytest.mark.parametrize("d", [8, 20, 896, 1536])
def test_rms_norm_is_the_rms_norm(d):
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(d)) * 3
    w = torch.rand(d, generator=torch.Generator().manual_seed(1)) + 0.5
    y = torch.ops.specstack_layer.rms_norm(x, w, 1e-6)
    assert torch.allclose(y, composite_rms(x, w, 1e-6), rtol=2e-6, atol=1e-6)


@native_only
@pytest.mark.parametrize("f", [4, 13, 4864])
def test_silu_mul_is_silu_times_up(f):
    g = torch.Generator().manual_seed(f)
    h = torch.randn(3, 2 * f, generator=g) * 6
    h[0, : min(f, 4)] = torch.tensor([-100.0, 100.0, 0.0, -87.5])[: min(f, 4)]  # past the exp's clamps
    y = torch.ops.specstack_layer.silu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    assert y.shape == (3, f)
    assert torch.allclose(y, F.silu(gate) * up, rtol=1e-6, atol=1e-30)


@native_only
@pytest.mark.parametrize("d", [16, 64, 128])
def test_rope_is_the_composites_numbers_bit_for_bit(d):
    x, cos, sin = rope_inputs(2, 3, 4, d)
    y = NATIVE.apply_rope(x, cos, sin)
    assert torch.equal(y, TORCH.apply_rope(x, cos, sin))
    assert y.is_contiguous()


@native_only
@pytest.mark.parametrize("rows", [1, 7, 64])  # 64 rows of these widths split over threads
def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it(rows):
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=g)
    w = torch.rand(1536, generator=g)
    h = torch.randn(rows, 2 * 1024, generator=g)
    q, cos, sin = rope_inputs(rows, 1, 16, 128)
    together = (NATIVE.rms_norm(x, w, 1e-6), NATIVE.silu_mul(h), NATIVE.apply_rope(q, cos, sin))
    for r in range(rows):
        alone = (NATIVE.rms_norm(x[r : r + 1], w, 1e-6), NATIVE.silu_mul(h[r : r + 1]),
                 NATIVE.apply_rope(q[r : r + 1], cos[r : r + 1], sin[r : r + 1]))
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a[r : r + 1], b)


@native_only
@pytest.mark.parametrize("dtype, rows", [("w4a8", "native"), ("w8a8", "native"), ("fp32", "torch")])
def test_the_fixed_order_attentions_models_take_the_native_rows(monkeypatch, tiny_llama, dtype, rows):
    monkeypatch.delenv("SPECSTACK_INVARIANT_ATTENTION", raising=False)
    model = load_model(str(tiny_llama.path), dtype=dtype, use_cache=False, tokenizer=False).model
    model.invariant_attention()
    blk = model.blocks()[0]
    assert blk.rows.name == rows and blk.attn_norm.rows.name == rows and model.norm.rows.name == rows


@native_only
def test_the_float64_attentions_models_keep_torchs_rows(monkeypatch, tiny_llama):
    monkeypatch.setenv("SPECSTACK_INVARIANT_ATTENTION", "float64")
    model = load_model(str(tiny_llama.path), dtype="w4a8", use_cache=False, tokenizer=False).model
    assert model.invariant_attention().name == "float64"
    assert model.blocks()[0].rows is TORCH and model.norm.rows is TORCH


@native_only
def test_the_ops_refuse_tensors_that_do_not_fit():
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.specstack_layer.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul"):
        torch.ops.specstack_layer.silu_mul(torch.randn(2, 7))
    x, cos, sin = rope_inputs(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="rope"):
        torch.ops.specstack_layer.rope(x, cos[:, :1], sin[:, :1])
