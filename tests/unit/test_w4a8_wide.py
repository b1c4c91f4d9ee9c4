"""The wide layout of w4a8's layer formats (models/w4a8_wide.py, models/kernels/w4a8_wide.cpp): its
rearrangement undone exactly for every format, a model's layers kept in it in place on the wide512 path
(and read back in their own layout by everything that reads numbers: float weights, a head's kept rows,
the built-model cache), and a layer that does not fit it computing, output by output, what one that does
computes. The kernels' agreement with the reference, row invariance and extreme products are
test_w4a8.py's, parametrised over every path (wide512 among them where the CPU has AVX-512-VNNI)."""
from __future__ import annotations

import pytest
import torch
from activations import kernel_inputs

from specstack.models import native, w4a8, w4a8_wide
from specstack.models.coded import Q5Weight
from specstack.models.quant import QLinear

WIDE = "wide512" in [k.name for k in w4a8.KERNELS if k.applies(torch.device("cpu"))]
wide_only = pytest.mark.skipif(not WIDE, reason="this CPU has no AVX-512-VNNI (the wide path runs where it has)")
LAYOUTS = ("w4a8", "q8a8", "k4a8", "k6a8", "q5a8")


def stored(layout: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A layer's tensors in its own layout, from random float weights through the format's quantiser."""
    lin = QLinear(k, n, layout)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    lin.method.fill_float(lin, w)  # the layers' own layout, whatever path this process runs
    return lin.method.stored(lin)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (32, 1536)])
def test_the_wide_layout_is_undone_exactly(layout, n, k):
    own = stored(layout, n, k)
    assert w4a8_wide.fits(layout, n, k)
    wide = w4a8_wide.to_wide(layout, *own)
    for a, b in zip(own, wide, strict=True):  # the same shapes and dtypes, other bytes
        assert (a is None and b is None) or (a.shape == b.shape and a.dtype == b.dtype)
    assert not torch.equal(own[0], wide[0])
    back = w4a8_wide.from_wide(layout, *wide, k)
    for a, b in zip(own, back, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def exact_half(own: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same layer with its scales rounded to fp16 values (as a GGUF's Q5_0 and Q8_0 scales are)."""
    codes, d, extra = own
    return codes, d.half().float(), extra


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scales_exact_in_fp16_are_kept_in_fp16(layout):
    """q5a8's and q8a8's wide layout holds a layer's scales in fp16 where every one is exact in it (half the
    bytes, the same numbers), fp32 otherwise; the other formats' scales stay fp32; undone exactly either way."""
    n, k = 32, 512
    for own, half in ((exact_half(stored(layout, n, k)), layout in w4a8_wide.HALF_SCALES), (stored(layout, n, k), False)):
        wide = w4a8_wide.to_wide(layout, *own)
        assert wide[1].dtype == (torch.float16 if half else torch.float32)
        back = w4a8_wide.from_wide(layout, *wide, k)
        assert back[1].dtype == torch.float32
        for a, b in zip(own, back, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@wide_only
@pytest.mark.parametrize("layout", sorted(w4a8_wide.HALF_SCALES))
@pytest.mark.parametrize("path", [p for p in w4a8.WIDE_PATHS if p in [k.name for k in w4a8.KERNELS
                                                                     if k.applies(torch.device("cpu"))]])
def test_fp16_scales_give_the_fp32_scales_numbers_bit_for_bit(layout, path):
    """The wide ops read fp16 scales (the kHalf tiles) and give what the same scales in fp32 give, at every
    tile shape (one row to more than two tiles; on the amx path, where fp16-scaled layers stay on the VNNI
    tiles, against its AMX tiles from one row)."""
    k = 1536
    codes, d, extra = w4a8_wide.to_wide(layout, *exact_half(stored(layout, 48, k, seed=6)))
    assert d.dtype == torch.float16
    suffix = w4a8.WIDE_PATHS[path]
    half, single = (w4a8_wide.kernel(layout, codes, s, extra, suffix) for s in (d, d.float()))
    x = kernel_inputs(40, k, seed=7)
    before = torch.ops.specstack_w4a8_wide.set_amx_from(1)
    try:
        for t in (1, 2, 3, 8, 9, 16, 17, 33, 40):
            assert torch.equal(half(x[:t]), single(x[:t])), f"{layout} {path}, {t} rows"
    finally:
        torch.ops.specstack_w4a8_wide.set_amx_from(before)


@wide_only
@pytest.mark.parametrize("layout", sorted(w4a8_wide.HALF_SCALES))
def test_fp16_scaled_layers_stay_on_the_vnni_tiles_under_the_amx_ops(layout):
    """The AMX tiles have not run fp16 scales on an AMX CPU yet (w4a8_wide.cpp `kOnAmxScales`), so the `_amx`
    ops give such a layer to the VNNI tiles at every row count, even with the tiles asked for from one row.
    On a CPU without AMX, as here, a call that reached the tiles would stop on an illegal instruction."""
    k = 512
    codes, d, extra = w4a8_wide.to_wide(layout, *exact_half(stored(layout, 32, k, seed=9)))
    vnni, amx = w4a8_wide.kernel(layout, codes, d, extra), w4a8_wide.kernel(layout, codes, d, extra, "_amx")
    x = kernel_inputs(40, k, seed=10)
    before = torch.ops.specstack_w4a8_wide.set_amx_from(1)
    try:
        for t in (1, 16, 33, 40):
            assert torch.equal(amx(x[:t]), vnni(x[:t])), f"{layout}, {t} rows"
    finally:
        torch.ops.specstack_w4a8_wide.set_amx_from(before)


@wide_only
def test_a_q5_layer_with_the_files_scales_holds_them_in_fp16(monkeypatch):
    """A q5a8 layer set from a GGUF's codes (fp16 scales) keeps them in fp16 on the wide path and reads
    back, saves, loads and cuts as the same layer in its own layout; set again from scales that are not
    exact in fp16, it holds fp32 (never the new scales rounded to fp16)."""
    n, k = 64, 512
    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    exact, inexact = Q5Weight(q, d.half().float()), Q5Weight(q, d)
    assert not torch.equal(d.half().float(), d)
    monkeypatch.setenv(w4a8.FORCE_ENV, "vnni512")
    own = QLinear(k, n, "q5a8").set_codes(exact)
    monkeypatch.setenv(w4a8.FORCE_ENV, "wide512")
    lin = QLinear(k, n, "q5a8").set_codes(exact)
    assert lin.wide_layout and lin.scales.dtype == torch.float16
    assert torch.equal(lin.float_weight(), own.float_weight())
    state = lin.state_dict()
    assert all(torch.equal(state[name], t) and state[name].dtype == t.dtype for name, t in own.state_dict().items())
    loaded = QLinear(k, n, "q5a8")
    loaded.load_state_dict(state)
    x = kernel_inputs(9, k)
    y = lin(x)
    assert loaded.scales.dtype == torch.float16 and torch.equal(loaded(x), y)
    rows = torch.arange(16, 32)
    cut = lin.take_rows(rows)
    assert cut.scales.dtype == torch.float16 and torch.equal(cut(x), y.index_select(1, rows))
    lin.set_codes(inexact)
    fresh = QLinear(k, n, "q5a8").set_codes(inexact)
    assert lin.scales.dtype == torch.float32 and torch.equal(lin.scales, fresh.scales) and torch.equal(lin(x), fresh(x))


def test_what_does_not_fit_in_place():
    assert not w4a8_wide.fits("w4a8", 40, 256)  # outputs not whole blocks of 16
    assert not w4a8_wide.fits("q5a8", 32, 96)  # q5a8's own layout pads a last chunk of 3 groups
    assert w4a8_wide.fits("q8a8", 32, 96)


@wide_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layer_on_the_wide_path_is_kept_wide_and_read_in_its_own_layout(layout, monkeypatch):
    """Built on wide512, a layer holds the wide layout; its float weights, its saved state and a copy
    of some of its rows are those of the same layer built on vnni512 (its own layout), and a layer
    loaded from that state is wide again and computes the same outputs bit for bit."""
    n, k = 64, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    monkeypatch.setenv(w4a8.FORCE_ENV, "vnni512")
    own = QLinear(k, n, layout).set_float(w)
    monkeypatch.setenv(w4a8.FORCE_ENV, "wide512")
    lin = QLinear(k, n, layout).set_float(w)
    assert lin.wide_layout and not own.wide_layout
    assert not torch.equal(lin.weight, own.weight)
    assert torch.equal(lin.float_weight(), own.float_weight())
    state = lin.state_dict()
    assert all(torch.equal(state[name], t) for name, t in own.state_dict().items())
    loaded = QLinear(k, n, layout)
    loaded.load_state_dict(state)
    assert loaded.wide_layout and torch.equal(loaded.weight, lin.weight)
    x = kernel_inputs(9, k)
    y = lin(x)
    assert torch.equal(loaded(x), y)
    rows = torch.tensor([5, 60, 17, 33, 0, 16, 31, 32, 47, 48, 63, 1, 2, 3, 4, 6])  # 16: kept wide
    cut = lin.take_rows(rows)
    assert cut.wide_layout and torch.equal(cut(x), y.index_select(1, rows))
    odd = lin.take_rows(rows[:7])  # not a block of 16: its own layout, a padded wide copy to compute
    assert not odd.wide_layout and torch.equal(odd(x), y.index_select(1, rows[:7]))
    assert lin.method.op(odd)[0] is None  # no one op runs it: the native decoder leaves such a model eager
    assert lin.method.op(lin)[0] == w4a8_wide.op_name(layout)


@wide_only
def test_rewriting_a_wide_layer_starts_from_its_own_layout(monkeypatch):
    """A wide layer set again (new weights or codes) is rearranged from what was written, never twice."""
    monkeypatch.setenv(w4a8.FORCE_ENV, "wide512")
    n, k = 32, 256
    g = torch.Generator().manual_seed(4)
    w1, w2 = (torch.randn(n, k, generator=g) * 0.05 for _ in range(2))
    lin = QLinear(k, n, "w4a8").set_float(w1)
    lin.set_float(w2)
    fresh = QLinear(k, n, "w4a8").set_float(w2)
    assert lin.wide_layout and torch.equal(lin.weight, fresh.weight) and torch.equal(lin.mins, fresh.mins)


@wide_only
def test_the_prefetch_distance_is_one_setting_for_both_libraries():
    """The wide library reads the same prefetch distance as w4a8's (one definition in w4a8_round.h), so
    benchmarks/prefetch_ab.py's setting reaches every kernel."""
    assert native.load("w4a8") and native.load("w4a8_wide")
    default = torch.ops.specstack_w4a8.set_prefetch(4096)
    try:
        assert torch.ops.specstack_w4a8_wide.set_prefetch(4096) == 4096
    finally:
        torch.ops.specstack_w4a8.set_prefetch(default)


def test_a_header_change_changes_the_build_flags(monkeypatch, tmp_path):
    """torch's builder rebuilds when a source or a flag changes, not a header the source includes: so the
    headers' hash is one of the flags (native.load passes it)."""
    (tmp_path / "a.h").write_text("// one\n")
    monkeypatch.setattr(native, "SOURCES", tmp_path)
    first = native._headers_flag()
    (tmp_path / "a.h").write_text("// two\n")
    assert native._headers_flag() != first and first.startswith("-DSPECSTACK_HEADERS=")
