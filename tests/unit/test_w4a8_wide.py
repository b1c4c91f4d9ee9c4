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
