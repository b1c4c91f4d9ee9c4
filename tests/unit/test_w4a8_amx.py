"""The w4a8 `amx` path (models/kernels/w4a8_amx.h, the `_amx` ops of models/kernels/w4a8_wide.cpp): calls
of many rows on AMX-INT8 tiles, fewer on the VNNI tiles, with the same numbers bit for bit. Here the tiles
are asked for from one row (`set_amx_from(1)`) and every output of every layer format and row count 1-64
must equal the VNNI tiles' (the same exact integer sums, the same float epilogue), so a process may take
either for any call and a row's numbers never depend on which did. Agreement with the reference and row
invariance at the default threshold are test_w4a8.py's (parametrised over every path, amx among them).
Runs where the CPU and its kernel grant AMX (a Xeon with AMX-INT8); elsewhere only the refusal is tested."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from activations import kernel_inputs

from specstack.errors import SpecstackError
from specstack.models import native, w4a8, w4a8_wide
from specstack.models.quant import QLinear

AMX = "amx" in [k.name for k in w4a8.KERNELS if k.applies(torch.device("cpu"))]
amx_only = pytest.mark.skipif(not AMX, reason="this CPU (or its kernel) has no AMX-INT8 (the path runs where it has)")
LAYOUTS = ("w4a8", "q8a8", "k4a8", "q5a8", "k6a8")  # k6a8 stays on the VNNI tiles (kOnAmx): checked alike


@pytest.fixture
def tiles_from_one_row() -> Iterator[None]:
    before = torch.ops.specstack_w4a8_wide.set_amx_from(1)
    try:
        yield
    finally:
        torch.ops.specstack_w4a8_wide.set_amx_from(before)


def wide_layer(layout: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    lin = QLinear(k, n, layout)
    lin.method.fill_float(lin, torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return w4a8_wide.to_wide(layout, *lin.method.stored(lin))


@amx_only
@pytest.mark.usefixtures("tiles_from_one_row")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 1536), (32, 8960)])
def test_the_amx_tiles_give_the_vnni_tiles_numbers_bit_for_bit(layout, n, k):
    wide = wide_layer(layout, n, k)
    vnni, amx = w4a8_wide.kernel(layout, *wide), w4a8_wide.kernel(layout, *wide, "_amx")
    x = kernel_inputs(64, k, seed=5)
    for t in (range(1, 65) if k <= 1536 else (1, 2, 15, 16, 17, 31, 33, 64)):
        assert torch.equal(amx(x[:t]), vnni(x[:t])), f"{layout} {k}->{n}, {t} rows"


@amx_only
@pytest.mark.usefixtures("tiles_from_one_row")
@pytest.mark.parametrize("layout", ("w4a8", "k4a8", "q8a8"))
def test_a_row_on_the_tiles_computes_what_it_does_alone(layout):
    """Rows in whole tiles of 16, in a last tile of fewer (read as a whole one into the scratch's padding),
    and alone: the same numbers."""
    k = 512
    run = w4a8_wide.kernel(layout, *wide_layer(layout, 64, k, seed=2), "_amx")
    x = kernel_inputs(40, k, seed=3)
    alone = torch.cat([run(x[i : i + 1]) for i in range(40)])
    for lo, hi in [(0, 40), (0, 16), (3, 20), (17, 40), (5, 6), (30, 37)]:
        assert torch.equal(run(x[lo:hi]), alone[lo:hi]), f"rows {lo}:{hi}"


@amx_only
def test_the_threshold_is_a_setting_that_changes_speed_only():
    ops = torch.ops.specstack_w4a8_wide
    before = ops.set_amx_from(7)
    try:
        assert ops.set_amx_from(before) == 7
        with pytest.raises(RuntimeError, match="row count >= 1"):
            ops.set_amx_from(0)
    finally:
        ops.set_amx_from(before)


@amx_only
def test_a_model_layer_on_the_amx_path_runs_its_amx_op(monkeypatch):
    """Built on the amx path, a layer keeps the wide layout (as on wide512) and names the `_amx` op, which the
    native decoder calls; on wide512 the same layer names the plain op."""
    monkeypatch.setenv(w4a8.FORCE_ENV, "amx")
    lin = QLinear(256, 32, "k4a8").set_float(torch.randn(32, 256, generator=torch.Generator().manual_seed(1)) * 0.05)
    assert lin.wide_layout and lin.method.op(lin)[0] == w4a8_wide.op_name("k4a8", "_amx")
    y = lin(kernel_inputs(20, 256))
    monkeypatch.setenv(w4a8.FORCE_ENV, "wide512")
    assert lin.method.op(lin)[0] == w4a8_wide.op_name("k4a8")
    assert torch.equal(lin.method.kernel(lin)(kernel_inputs(20, 256)), y)


def test_amx_forced_where_the_cpu_or_its_kernel_refuses_it_is_refused(monkeypatch):
    """A CPU without AMX (or a kernel that does not grant it) never runs a tile instruction: forcing the path
    is refused with the paths that can run, and the table falls to wide512 (or below) on its own."""
    monkeypatch.setattr(native, "has_amx", lambda: False)
    monkeypatch.setenv(w4a8.FORCE_ENV, "amx")
    with pytest.raises(SpecstackError, match="'amx': this cpu cannot run it; here: "):
        w4a8.kernel_for(torch.device("cpu"))
    monkeypatch.delenv(w4a8.FORCE_ENV)
    assert w4a8.kernel_for(torch.device("cpu")).name != "amx"


def test_a_kernel_that_refuses_amx_is_said_once(monkeypatch, capsys):
    """The CPU's flags say AMX but Linux does not grant its state to the process: one line on stderr, and
    no AMX (the tiles would fault)."""
    monkeypatch.setattr(native, "has_vnni512", lambda: True)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_tile": True, "amx_int8": True})
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    native.has_amx.cache_clear()
    try:
        assert not native.has_amx() and not native.has_amx()
        assert capsys.readouterr().err.count("did not grant it") == 1
    finally:
        native.has_amx.cache_clear()
