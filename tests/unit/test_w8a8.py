"""The w8a8 format (models/w8a8.py): its kernels against the reference arithmetic and the dequantised
matmul, rows that do not depend on the rows beside them, no saturation on AVX2, and the fallback a CPU
without fbgemm gets."""
from __future__ import annotations

import pytest
import torch
from activations import kernel_inputs

from specstack.models import w8a8
from specstack.models.quant import QLinear

SHAPES = [(64, 48), (576, 1536), (1536, 2048), (896, 4864), (8960, 1536)]  # (in, out): head-, MLP- and odd-sized
ROWS = [1, 2, 3, 8, 9, 16, 17, 32, 33]
KERNELS = [k.name for k in w8a8.KERNELS if k.applies(torch.device("cpu"))]


def layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, :5] = 0.5  # an outlier weight: its row's scale differs from the others
    return w8a8.quantize_weight(w)


inputs = kernel_inputs


def dequantised_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format's arithmetic written out: x rounded per row in fp32 (its definition), then the
    dequantised x and w = codes * scale multiplied in float64."""
    scale = x.abs().amax(1, keepdim=True).clamp(min=1e-30) * (1.0 / w8a8.X_LEVELS)
    xq = (x / scale).round().double() * scale.double()
    return (xq @ (codes.double() * scales.double()[:, None]).t()).float()


def test_weight_codes_stay_in_seven_bits_and_round_trip():
    w = torch.randn(40, 64)
    codes, scales = w8a8.quantize_weight(w)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == w8a8.W_LEVELS
    assert torch.allclose(codes.float() * scales[:, None], w, atol=float(scales.max()) / 2 + 1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_equals_the_reference_and_the_dequantised_matmul(kernel, k, n):
    codes, scales = layer(k, n)
    run = {c.name: c for c in w8a8.KERNELS}[kernel].build(codes, scales)
    ref = w8a8.reference(codes, scales)
    for t in ROWS:
        x = inputs(t, k)
        y = run(x)
        assert torch.equal(y, ref(x)), f"{kernel} {k}->{n}, {t} rows: not the reference's numbers"
        want = dequantised_matmul(x, codes, scales)
        tol = 1e-5 * want.abs().amax(1, keepdim=True) + 1e-30  # fp32 rounding of the scaling, per row
        assert ((y - want).abs() <= tol).all(), f"{kernel} {k}->{n}, {t} rows: off the dequantised matmul"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k,n", SHAPES[:3])
def test_a_row_computes_the_same_numbers_whatever_shares_its_forward(kernel, k, n):
    codes, scales = layer(k, n)
    run = {c.name: c for c in w8a8.KERNELS}[kernel].build(codes, scales)
    x = inputs(40, k)
    alone = torch.cat([run(x[i : i + 1]) for i in range(40)])
    for lo, hi in [(0, 40), (0, 8), (3, 20), (17, 40), (5, 6)]:
        assert torch.equal(run(x[lo:hi]), alone[lo:hi]), f"rows {lo}:{hi} differ from the same rows alone"


@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_products_do_not_saturate(kernel):
    """Every activation at +-max and every weight at +-63 of the same sign: the pairs vpmaddubsw sums
    into int16 are as large as the format allows, and must still sum exactly."""
    k, n = 1024, 64
    codes = torch.full((n, k), w8a8.W_LEVELS, dtype=torch.int8)
    codes[n // 2 :] *= -1
    scales = torch.ones(n)
    run = {c.name: c for c in w8a8.KERNELS}[kernel].build(codes, scales)
    x = torch.ones(4, k)
    x[1] *= -1
    x[2, ::2] = -1  # alternating signs: pairs that cancel
    y = run(x)
    want = (x.sign().double() * w8a8.X_LEVELS) @ codes.double().t() * scales.double() / w8a8.X_LEVELS
    assert torch.allclose(y.double(), want, rtol=1e-6, atol=0)


def test_the_kernel_is_chosen_from_the_cpu_and_falls_back_without_fbgemm(monkeypatch):
    cpu = torch.device("cpu")
    assert w8a8.kernel_for(cpu).name == ("fbgemm" if w8a8._fbgemm_available() else "reference")
    monkeypatch.setattr(w8a8, "_fbgemm_available", lambda: False)  # a CPU / build without fbgemm
    assert w8a8.kernel_for(cpu).name == "reference"
    assert w8a8.kernel_for(torch.device("meta")).name == "reference"  # not a CPU: never fbgemm


def test_a_forced_kernel_is_used_and_a_wrong_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(w8a8.FORCE_ENV, "reference")
    assert w8a8.kernel_for(torch.device("cpu")).name == "reference"
    monkeypatch.setenv(w8a8.FORCE_ENV, "vnni512")
    from specstack.errors import SpecstackError

    with pytest.raises(SpecstackError, match="vnni512.*fbgemm, reference"):
        w8a8.kernel_for(torch.device("cpu"))


def test_qlinear_w8a8_computes_with_bias_in_fp32_on_either_kernel(monkeypatch):
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    lin = QLinear(64, 96, "w8a8", bias=True).set_float(w, b)
    assert lin.act_dtype == torch.float32 and lin.weight.dtype == torch.int8
    assert lin.step_bytes() == 96 * 64 + 96 * 4 + 96 * 4  # codes, fp32 scales, fp32 bias
    x = torch.randn(5, 64)
    y = lin(x)
    want = dequantised_matmul(x, lin.weight, lin.scales) + b
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(w8a8, "_fbgemm_available", lambda: False)
    lin.unbind()
    assert torch.equal(lin(x), y)  # the fallback computes the very same numbers
    assert torch.allclose(lin.float_weight(), w, atol=float(lin.scales.max()) / 2 + 1e-7)
    with pytest.raises(ValueError, match="w8a8 weights compute in torch.float32"):
        QLinear(64, 96, "w8a8", activation=torch.bfloat16)
