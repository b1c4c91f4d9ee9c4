"""The batch-invariant formats' attention (models/fixed_attention.py, models/kernels/attention.cpp): the
C++ kernel against torch's attention in float64 for masks, causal blocks, grouped-query heads and cache
views; a query's numbers bit for bit those it has alone, beside any other queries, rows or invisible
keys; the table's choice and the cache dtype that goes with it, and the float64 fallback on a whole model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specstack.attention import build_batch
from specstack.errors import SpecstackError
from specstack.models import fixed_attention
from specstack.models.loading import load_model

CPU = torch.device("cpu")
has_fixed = fixed_attention.KERNELS[0].applies(CPU)
fixed_only = pytest.mark.skipif(not has_fixed, reason="the attention kernel does not build on this CPU (no AVX2)")


def op(q, k, v, mask=None, causal=False):
    return torch.ops.specstack_attention.fixed.default(q, k, v, mask, causal)


def cache_views(b: int, hkv: int, s: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, S, D] as a cache hands them over: views of the first S of more slots."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, s + 24, d, generator=g)
    v = torch.randn(b, hkv, s + 24, d, generator=g)
    return k[:, :, :s], v[:, :, :s]


def sdpa64(q, k, v, mask=None, causal=False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1]).float()


@fixed_only
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 2, 128), (14, 2, 64), (9, 3, 64), (4, 4, 128), (18, 1, 64)])
def test_the_kernel_agrees_with_torch_in_float64(heads, kv_heads, d):
    """Random masks (each query sees its own slot), no mask, and a causal block over an empty cache; the
    grouped heads tile by up to 8 (18 heads on one key/value head: two tiles and a remainder)."""
    b, t, s = 2, 5, 37
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(b, heads, t, d, generator=g)
    k, v = cache_views(b, kv_heads, s, d)
    mask = torch.rand(b, 1, t, s, generator=g) > 0.4
    mask[:, :, torch.arange(t), s - t + torch.arange(t)] = True
    assert (op(q, k, v, mask) - sdpa64(q, k, v, mask)).abs().max() < 2e-6
    assert (op(q, k, v) - sdpa64(q, k, v)).abs().max() < 2e-6
    qc = torch.randn(b, heads, s, d, generator=g)
    assert (op(qc, k, v, causal=True) - sdpa64(qc, k, v, causal=True)).abs().max() < 2e-6


@fixed_only
def test_a_query_computes_what_it_computes_alone():
    """Bit for bit: a query in a causal block as the same query alone over the keys it sees; beside
    other rows of a batch; with invisible keys after its own (longer caches, masked slots)."""
    b, h, hkv, d, s = 3, 12, 2, 128, 29
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, s, d, generator=g)
    k, v = cache_views(b, hkv, s, d, seed=2)
    block = op(q, k, v, causal=True)
    for t in (0, 7, s - 1):
        alone = op(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        assert torch.equal(alone, block[:, :, t : t + 1]), f"query {t}"
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[..., : t + 1] = True
        assert torch.equal(op(q[:, :, t : t + 1], k, v, mask), alone), f"query {t} with masked slots"
    for r in range(b):
        assert torch.equal(op(q[r : r + 1], k[r : r + 1], v[r : r + 1], causal=True), block[r : r + 1]), f"row {r}"


@fixed_only
def test_bad_inputs_are_refused():
    q = torch.randn(1, 4, 2, 64)
    k, v = cache_views(1, 2, 5, 64)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k, v)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(1, 3, 2, 64), k, v)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(torch.randn(1, 4, 2, 12), *cache_views(1, 2, 5, 12))
    with pytest.raises(RuntimeError, match="mask"):
        op(q, k, v, torch.ones(1, 1, 2, 4, dtype=torch.bool))


def test_the_table_chooses_and_the_cache_follows(monkeypatch, tiny_llama):
    """The fixed kernel where it builds (an fp32 cache), float64 when forced or elsewhere; a forced kernel
    the device cannot run is refused."""
    want = "fixed" if has_fixed else "float64"
    assert fixed_attention.invariant_attention(CPU).name == want
    assert fixed_attention.invariant_attention(torch.device("meta")).name == "float64"
    model = load_model(str(tiny_llama.path), dtype="w4a8", use_cache=False, tokenizer=False).model
    assert model.kv_dtype == (torch.float32 if has_fixed else torch.float64)
    assert load_model(str(tiny_llama.path), dtype="fp32", use_cache=False, tokenizer=False).model.invariant_attention() is None
    monkeypatch.setenv(fixed_attention.FORCE_ENV, "float64")
    assert fixed_attention.invariant_attention(CPU).kv_dtype == torch.float64
    monkeypatch.setenv(fixed_attention.FORCE_ENV, "fixed")
    with pytest.raises(SpecstackError, match="cannot run it"):
        fixed_attention.invariant_attention(torch.device("meta"))


def test_the_float64_fallback_keeps_a_model_batch_invariant(monkeypatch, tiny_llama):
    """Where the kernel does not build: torch's attention over a float64 cache, and a chain still scores
    each token as one-token steps do."""
    monkeypatch.setenv(fixed_attention.FORCE_ENV, "float64")
    model = load_model(str(tiny_llama.path), dtype="w4a8", use_cache=False, tokenizer=False).model
    assert model.kv_dtype == torch.float64 and all(blk.attention is None for blk in model.blocks())
    prompt, cont = torch.tensor([[5, 9, 14, 3, 77, 21]]), [8, 40, 2, 91]
    cache = model.new_cache(1)
    model.extend(prompt, cache)
    chain = model.forward(torch.tensor([cont]), build_batch(cache, len(cont)), cache).logits[0]
    cache = model.new_cache(1)
    model.extend(prompt, cache)
    steps = torch.cat([model.extend(torch.tensor([[t]]), cache).logits[0] for t in cont])
    assert torch.equal(chain, steps)


@fixed_only
@pytest.mark.parametrize("spread", [3.0, 30.0])
def test_the_softmax_weights_hold_over_a_wide_range_of_scores(spread):
    """The kernel's vectorised exp over score differences down to about -150 (weights underflowing to 0)
    and key counts that leave every partial vector of 8 (the tail padded with -inf)."""
    g = torch.Generator().manual_seed(7)
    for s in (1, 5, 8, 13, 64, 203):
        q = torch.randn(1, 4, 1, 64, generator=g) * spread
        k, v = cache_views(1, 2, s, 64, seed=s)
        want = sdpa64(q, k, v)
        assert (op(q, k, v) - want).abs().max() <= 2e-6 * max(1.0, want.abs().max().item()), s


wide_only = pytest.mark.skipif(not (has_fixed and torch.backends.cpu.get_cpu_capability() == "AVX512"),
                               reason="the attention's AVX-512 loops need an AVX-512 CPU")


@wide_only
@pytest.mark.parametrize("heads,kv_heads,d,s", [(12, 2, 128, 37), (14, 2, 64, 36), (9, 3, 24, 5), (18, 1, 64, 1),
                                                (4, 4, 8, 50)])
def test_the_avx512_loops_compute_the_8_lane_loops_numbers(heads, kv_heads, d, s):
    """Bit for bit, with odd and even key counts, head dimensions an odd multiple of 8 (the last chunk
    through the 8-lane loop), tiles of 1 to 8 heads, masks and causal blocks: a wider vector is two 8-lane
    vectors side by side, each doing what the 8-lane loop does."""
    b, t = 2, 5
    g = torch.Generator().manual_seed(heads + d)
    q = torch.randn(b, heads, t, d, generator=g)
    k, v = cache_views(b, kv_heads, s, d)
    mask = torch.rand(b, 1, t, s, generator=g) > 0.4
    mask[:, :, torch.arange(t), torch.arange(t) % s] = True
    qc = torch.randn(b, heads, s, d, generator=g)
    calls = [lambda: op(q, k, v, mask), lambda: op(q, k, v), lambda: op(qc, k, v, causal=True)]
    try:
        assert torch.ops.specstack_attention.set_wide(True)  # on by default where the CPU has AVX-512
        wide = [call() for call in calls]
        torch.ops.specstack_attention.set_wide(False)
        narrow = [call() for call in calls]
    finally:
        torch.ops.specstack_attention.set_wide(True)
    for a, n in zip(wide, narrow, strict=True):
        assert torch.equal(a, n)
