"""The w4a8 format (models/w4a8.py, models/kernels/w4a8.cpp), its 4-bit groups, its 8-bit ones
(q8a8), Q4_K's super-blocks (k4a8) and Q6_K's 6-bit groups (k6a8): the C++ kernel's rounding of the activations bit for bit the reference's, its products against
the reference and the dequantised matmul for every shape class and row count, rows that do not depend
on the rows beside them (both kernels), the largest products without saturation, GGUF codes kept
exactly, and the fallback a CPU without AVX2 gets (or one where the kernel does not build)."""
from __future__ import annotations

import pytest
import torch
from activations import kernel_inputs

from specstack.errors import SpecstackError
from specstack.models import native, w4a8, w4a8_codes
from specstack.models.quant import QLinear

SHAPES = [(64, 48), (576, 1536), (1536, 2048), (896, 4864), (8960, 1536), (96, 40)]  # (in, out); 96: 3 groups
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33]
KERNELS = [k.name for k in w4a8.KERNELS if k.applies(torch.device("cpu"))]
native_only = pytest.mark.skipif("avx2" not in KERNELS, reason="this CPU has no AVX2 (the reference is tested)")
vnni_only = pytest.mark.skipif("vnni512" not in KERNELS, reason="this CPU has no AVX-512-VNNI (its path runs where it has)")


BITS = (4, 8)


def layer(k: int, n: int, seed: int = 0, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stored codes, d and m as a GGUF Q4_1 file holds them (d > 0, any m), or 8-bit groups (Q8_0: codes
    in -127..127, no m), with a few odd groups."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    d[-1, -1] = 0.5  # an outlier group
    if bits == 8:
        c8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        c8[0, :32] = 0  # an all-zero group
        return c8, d, None
    c = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    m = (torch.rand(n, k // 32, generator=g) - 0.7) * 0.1
    d[0, 0], m[0, 0] = 0.0, 0.0  # an all-zero group
    return w4a8_codes.pack_codes(c), d, m


inputs = kernel_inputs


def layout_of(m: torch.Tensor | None, sub: torch.Tensor | None = None) -> str:
    """The layer format of per-group tensors: 4-bit groups with mins, 8-bit ones without, or with
    super-blocks (sub: k4a8's uint8 (sc, mn), k6a8's int8 scales)."""
    if sub is not None:
        return "k6a8" if sub.dtype == torch.int8 else "k4a8"
    return "w4a8" if m is not None else "q8a8"


def dequantize(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, sub: torch.Tensor | None = None):
    return w4a8.dequantize(layout_of(m, sub), packed, d, m if sub is None else sub)


def dequantised_matmul(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                       sub: torch.Tensor | None = None) -> torch.Tensor:
    """The format written out: x rounded per group (its definition), then the dequantised x and w
    multiplied in float64."""
    q, dx, _ = w4a8.quantize_groups(x)
    xq = (q.view(x.shape[0], -1, 32).double() * dx.double()[..., None]).view(x.shape)
    return (xq @ dequantize(packed, d, m, sub).double().t()).float()


def tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per row: fp32 sums over k / 32 groups (avx2) or float64 (the reference) stay within a few ulps
    of the largest product, times the square root of the number of groups."""
    scale = (x.abs().amax(1, keepdim=True) * w.abs().amax()).clamp(min=1e-30)
    return 8e-6 * (x.shape[1] / 32) ** 0.5 * scale + 1e-30


def kernel(name: str, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
           sub: torch.Tensor | None = None):
    extra = m if sub is None else sub
    return {c.name: c for c in w4a8.KERNELS}[name].build(layout_of(m, sub), packed, d, extra)


def reference(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, sub: torch.Tensor | None = None):
    return w4a8.reference(layout_of(m, sub), packed, d, m if sub is None else sub)


def test_codes_pack_and_unpack_and_float_weights_round_trip():
    c = torch.randint(0, 16, (24, 96), dtype=torch.uint8)
    packed = w4a8_codes.pack_codes(c)
    assert packed.shape == (24, 48) and torch.equal(w4a8_codes.unpack_codes(packed), c)
    assert int(packed[0, 0]) == int(c[0, 0]) | int(c[0, 16]) << 4  # the kernel's nibble order
    w = torch.randn(24, 96)
    codes, d, m = w4a8.quantize_weight(w)
    assert int(codes.max()) <= 15
    step = d.repeat_interleave(32, dim=1)
    assert (dequantize(w4a8_codes.pack_codes(codes), d, m) - w).abs().le(step / 2 + 1e-6).all()
    c8, d8 = w4a8.quantize_weight8(w)
    assert c8.dtype == torch.int8 and int(c8.abs().max()) == 127
    assert (dequantize(c8, d8, None) - w).abs().le(d8.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


@native_only
def test_the_kernel_rounds_activations_as_the_reference_does_bit_for_bit():
    for scale in (1e-6, 1.0, 3e4):
        x = inputs(9, 256) * scale
        q, dx, sx = torch.ops.specstack_w4a8.quantize(x)
        rq, rdx, rsx = w4a8.quantize_groups(x)
        assert torch.equal(q.float(), rq) and torch.equal(dx, rdx) and torch.equal(sx, rsx)


@vnni_only
def test_the_vnni_path_rounds_activations_as_the_reference_does_bit_for_bit():
    for scale in (1e-6, 1.0, 3e4):
        x = inputs(9, 576) * scale  # 18 groups: four whole chunks of 4 and two groups past them
        x[0, :32] = 0.0  # an all-zero group
        x[1, 5] = 127.5 * x[1, :32].abs().max() / 127  # a value on a rounding tie
        q, dx, sx = torch.ops.specstack_w4a8.quantize_vnni(x)
        rq, rdx, rsx = w4a8.quantize_groups(x)
        assert torch.equal(q.float(), rq) and torch.equal(dx, rdx) and torch.equal(sx, rsx)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_agrees_with_the_reference_and_the_dequantised_matmul(name, k, n, bits):
    packed, d, m = layer(k, n, bits=bits)
    run, ref = kernel(name, packed, d, m), reference(packed, d, m)
    for t in ROWS if k * n < 5_000_000 else ROWS[::3]:
        x = inputs(t, k)
        y, want = run(x), dequantised_matmul(x, packed, d, m)
        tol = tolerance(x, dequantize(packed, d, m))
        assert ((y - want).abs() <= tol).all(), f"{name} {k}->{n}, {t} rows: off the dequantised matmul"
        assert ((y - ref(x)).abs() <= tol).all(), f"{name} {k}->{n}, {t} rows: off the reference"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("k,n", SHAPES[:3] + SHAPES[-1:])
def test_a_row_computes_the_same_numbers_whatever_shares_its_forward(name, k, n, bits):
    packed, d, m = layer(k, n, bits=bits)
    run = kernel(name, packed, d, m)
    x = inputs(40, k)
    alone = torch.cat([run(x[i : i + 1]) for i in range(40)])
    for lo, hi in [(0, 40), (0, 8), (3, 20), (17, 40), (5, 6), (1, 4), (30, 37)]:
        assert torch.equal(run(x[lo:hi]), alone[lo:hi]), f"rows {lo}:{hi} differ from the same rows alone"


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("k,n", [(256, 48), (1536, 2048), (8960, 1536)])
def test_super_blocks_compute_what_their_groups_do_bit_for_bit(name, k, n):
    """k4a8 (GGUF Q4_K's super-blocks) on every path: the same outputs as the per-group layout holding
    d = D sc and m = M mn, bit for bit, at every row count (so its rows are as invariant as w4a8's)."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    sup = torch.stack([torch.rand(n, k // 256, generator=g) * 1e-3, -torch.rand(n, k // 256, generator=g) * 1e-3], -1)
    sub = torch.randint(0, 64, (n, 2, k // 32), generator=g, dtype=torch.uint8)
    packed = w4a8_codes.pack_codes(codes)
    d, m = w4a8.expand_scales(sup, sub)
    assert torch.equal(d, sup[..., 0].repeat_interleave(8, 1) * sub[:, 0].float())
    run, groups = kernel(name, packed, sup, None, sub), kernel(name, packed, d, m)
    x = inputs(33, k)
    alone = torch.cat([run(x[i : i + 1]) for i in range(33)])
    for t in ROWS:
        assert torch.equal(run(x[:t]), groups(x[:t])), f"{name} {k}->{n}, {t} rows"
        assert torch.equal(run(x[:t]), alone[:t]), f"{name} {k}->{n}: {t} rows differ from the rows alone"
    tol = tolerance(x, dequantize(packed, d, m))
    assert ((run(x) - dequantised_matmul(x, packed, d, m)).abs() <= tol).all()


def test_a_float_weight_into_super_blocks_stays_within_a_step():
    w = torch.randn(24, 512) * 0.05
    lin = QLinear(512, 24, "k4a8").set_float(w)
    d, _ = w4a8.expand_scales(lin.scales, lin.subscales)
    assert ((lin.float_weight() - w).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-7).all()
    with pytest.raises(SpecstackError, match="divisible by 256"):
        QLinear(96, 8, "k4a8")


def six_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k6a8's stored codes, D [N, K / 256] and int8 scales [N, K / 16] as GGUF Q6_K holds them (scales of
    either sign, the extremes among them)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    big = torch.rand(n, k // 256, generator=g) * 1e-4
    s16 = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    s16[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    return w4a8_codes.pack_codes6(codes), big, s16


def test_six_bit_codes_pack_and_unpack_in_the_kernels_order():
    c = torch.randint(0, 64, (6, 512), dtype=torch.uint8)
    packed = w4a8_codes.pack_codes6(c)
    assert packed.shape == (6, 384) and torch.equal(w4a8_codes.unpack_codes6(packed), c)
    # a chunk: the 4 groups' nibbles as pack_codes packs them, then byte j of the plane holding the top
    # bits of group 0's code j, group 2's code j, group 0's code 16 + j and group 2's code 16 + j
    assert torch.equal(packed[:, :64], w4a8_codes.pack_codes(c[:, :128] & 15))
    top = c[:, :128] >> 4
    want = top[:, 3] | top[:, 64 + 3] << 2 | top[:, 16 + 3] << 4 | top[:, 64 + 16 + 3] << 6
    assert torch.equal(packed[:, 64 + 3], want)
    assert torch.equal(packed[:, 64 + 16 + 3], top[:, 32 + 3] | top[:, 96 + 3] << 2 | top[:, 48 + 3] << 4
                       | top[:, 112 + 3] << 6)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("k,n", [(256, 48), (1536, 2048), (8960, 1536), (512, 40)])
def test_six_bit_groups_agree_with_the_reference_and_keep_rows_invariant(name, k, n):
    """k6a8 (GGUF Q6_K) on every path: against the reference and the dequantised matmul at every row
    count, and each row's numbers those it has alone."""
    packed, big, s16 = six_layer(k, n)
    run, ref = kernel(name, packed, big, None, s16), reference(packed, big, None, s16)
    x = inputs(33, k)
    alone = torch.cat([run(x[i : i + 1]) for i in range(33)])
    tol = tolerance(x, dequantize(packed, big, None, s16))
    for t in ROWS if k * n < 5_000_000 else ROWS[::3]:
        y = run(x[:t])
        assert torch.equal(y, alone[:t]), f"{name} {k}->{n}: {t} rows differ from the rows alone"
        assert ((y - ref(x[:t])).abs() <= tol[:t]).all(), f"{name} {k}->{n}, {t} rows: off the reference"
        want = dequantised_matmul(x[:t], packed, big, None, s16)
        assert ((y - want).abs() <= tol[:t]).all(), f"{name} {k}->{n}, {t} rows: off the dequantised matmul"


@pytest.mark.parametrize("name", KERNELS)
def test_six_bit_extreme_products_stay_exact(name):
    """Codes 0 and 63 (c - 32 = -32, 31) under scales -128 and 127 against activations at +-127: the
    integer sums at the format's largest (vpdpbusd lanes of 4 * 32 * 127 packed to int16, vpmaddwd
    pairs times 128) with no saturation, compared in float64 with the dequantised matmul."""
    k, n = 1024, 8
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[n // 2 :] = 63
    s16 = torch.full((n, k // 16), -128, dtype=torch.int8)
    s16[::2] = 127
    packed, big = w4a8_codes.pack_codes6(codes), torch.ones(n, k // 256)
    x = torch.ones(3, k)
    x[1] *= -1
    x[2, ::2] *= -1
    y = kernel(name, packed, big, None, s16)(x)
    want = dequantised_matmul(x, packed, big, None, s16)
    assert ((y - want).abs() <= 1e-6 * want.abs().max()).all(), (y, want)


def test_a_float_weight_into_six_bit_groups_stays_within_a_step():
    w = torch.randn(24, 512) * 0.05
    lin = QLinear(512, 24, "k6a8").set_float(w)
    unit = lin.scales.repeat_interleave(16, 1) * lin.subscales.float()
    assert ((lin.float_weight() - w).abs() <= unit.repeat_interleave(16, 1) / 2 + 1e-7).all()
    assert lin.step_bytes() == 24 * 512 * 3 // 4 + 24 * 2 * 4 + 24 * 32  # codes, fp32 D, int8 scales
    with pytest.raises(SpecstackError, match="divisible by 256"):
        QLinear(96, 8, "k6a8")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", KERNELS)
def test_extreme_products_do_not_saturate(name, bits):
    """The largest codes against activations at +-127: vpmaddubsw's pair sums are as large as the
    format allows (2 * 15 * 127, or 2 * 127 * 127 for 8-bit groups of either sign) and must still sum
    exactly."""
    k, n, top = 1024, 8, 15 if bits == 4 else 127
    if bits == 4:
        stored, m = w4a8_codes.pack_codes(torch.full((n, k), top, dtype=torch.uint8)), torch.zeros(n, k // 32)
    else:
        stored, m = torch.full((n, k), top, dtype=torch.int8), None
        stored[n // 2 :] *= -1
    run = kernel(name, stored, torch.ones(n, k // 32), m)
    x = torch.ones(3, k)
    x[1] *= -1
    y = run(x)
    want = torch.full((n,), float(top * k))
    if bits == 8:
        want[n // 2 :] *= -1
    assert torch.equal(y[0], want) and torch.equal(y[1], -want)


def test_gguf_codes_are_kept_exactly_and_the_layer_adds_its_bias():
    n, k = 40, 64
    packed, d, m = layer(k, n, seed=3)
    lin = QLinear(k, n, "w4a8", bias=True)
    lin.set_int4(w4a8_codes.unpack_codes(packed), d, m)
    assert torch.equal(lin.weight, packed) and torch.equal(lin.scales, d) and torch.equal(lin.mins, m)
    assert lin.step_bytes() == n * k // 2 + 2 * n * (k // 32) * 4 + n * 4  # codes, fp32 d and m, fp32 bias
    lin.bias.copy_(torch.randn(n))
    lin.unbind()
    x = inputs(5, k)
    assert ((lin(x) - dequantised_matmul(x, packed, d, m) - lin.bias).abs() <= tolerance(x, lin.float_weight())).all()
    assert torch.equal(lin.float_weight(), dequantize(packed, d, m))
    with pytest.raises(ValueError, match="w4a8 weights compute in torch.float32"):
        QLinear(64, 96, "w4a8", activation=torch.bfloat16)
    with pytest.raises(SpecstackError, match="divisible by 32"):
        QLinear(40, 8, "w4a8")
    q8 = QLinear(k, n, "q8a8").set_float(lin.float_weight())  # the 8-bit groups of the same weight
    assert q8.weight.dtype == torch.int8 and not hasattr(q8, "mins")
    assert q8.step_bytes() == n * k + n * (k // 32) * 4
    y8 = q8(x)
    assert ((y8 - dequantised_matmul(x, q8.weight, q8.scales, None)).abs() <= tolerance(x, q8.float_weight())).all()


def test_the_kernel_is_chosen_from_the_cpu_and_a_forced_one_is_used(monkeypatch):
    cpu = torch.device("cpu")
    has_avx2 = native.cpu_capability() in native.CPU_FLAGS["w4a8"]
    built = has_avx2 and native.load("w4a8")
    want = ("amx" if native.has_amx() else "wide512" if native.has_vnni512() else "avx2") if built else "reference"
    assert w4a8.kernel_for(cpu).name == want
    assert w4a8.kernel_for(torch.device("meta")).name == "reference"  # not a CPU: never the C++ kernel
    monkeypatch.setattr(native, "cpu_capability", lambda: "DEFAULT")  # a CPU without AVX2
    native.load.cache_clear()
    try:
        assert not native.supported("w4a8") and w4a8.kernel_for(cpu).name == "reference"
    finally:
        native.load.cache_clear()
    monkeypatch.setenv(w4a8.FORCE_ENV, "reference")
    assert w4a8.kernel_for(cpu).name == "reference"
    monkeypatch.setenv(w4a8.FORCE_ENV, "sme")
    with pytest.raises(SpecstackError, match="sme.*amx, wide512, vnni512, avx2, reference"):
        w4a8.kernel_for(cpu)
    # a path forced where it cannot run is refused, never run (its instructions would kill the process)
    monkeypatch.setattr(native, "has_vnni512", lambda: False)
    monkeypatch.setattr(native, "has_amx", lambda: False)
    for path in ("amx", "wide512", "vnni512"):
        monkeypatch.setenv(w4a8.FORCE_ENV, path)
        with pytest.raises(SpecstackError, match=f"{path}.*cannot run it"):
            w4a8.kernel_for(cpu)
    monkeypatch.setenv(w4a8.FORCE_ENV, "avx2")
    with pytest.raises(SpecstackError, match="avx2.*cannot run it; here: reference"):
        w4a8.kernel_for(torch.device("meta"))


def test_a_layer_computes_the_same_on_the_fallback_up_to_rounding(monkeypatch):
    w = torch.randn(96, 64) * 0.1
    lin = QLinear(64, 96, "w4a8").set_float(w)
    x = inputs(6, 64)
    y = lin(x)
    monkeypatch.setenv(w4a8.FORCE_ENV, "reference")
    lin.unbind()
    assert ((lin(x) - y).abs() <= tolerance(x, lin.float_weight())).all()


def test_a_kernel_that_does_not_build_is_reported_once_and_the_reference_is_used(monkeypatch, tmp_path, capsys):
    if not native.supported("w4a8"):
        pytest.skip("this CPU has no AVX2 or no compiler: nothing is built here")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w4a8.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCES", tmp_path / "src")
    monkeypatch.setattr(native, "_LOADED", set())  # as in a process that has not loaded it yet
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    native.load.cache_clear()
    try:
        assert native.load("w4a8") is False
        assert w4a8.kernel_for(torch.device("cpu")).name == "reference"
    finally:
        native.load.cache_clear()
    err = capsys.readouterr().err
    assert "building the w4a8 kernel" in err and "could not be built" in err and "reference" in err
    assert err.count("could not be built") == 1  # chosen once: later layers do not try again


def test_a_process_that_changes_its_cache_folder_keeps_the_kernel_it_loaded(monkeypatch, tmp_path):
    if not native.load("w4a8"):
        pytest.skip("no AVX2 kernel on this machine")
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))  # as a test or a user switching caches does
    native.load.cache_clear()
    try:
        assert native.load("w4a8") and not (tmp_path / "kernels").exists()  # no second build, no second library
    finally:
        native.load.cache_clear()


def test_a_model_built_under_an_older_w4a8_layout_is_rebuilt_not_loaded(monkeypatch, tmp_path, tiny_llama):
    from dataclasses import replace

    from specstack.models.loading import load_model, model_cache_dir
    from specstack.models.registry import resolve
    from specstack.weight_formats import FORMATS

    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    first = load_model(str(tiny_llama.path), dtype="w4a8", tokenizer=False).model
    cdir = model_cache_dir(resolve(str(tiny_llama.path)))
    built = sorted(p.name for p in cdir.glob("w4a8*"))
    rev = FORMATS["w4a8"].revision
    assert rev is not None and built == [f"w4a8.r{rev}-cpu.safetensors"]
    # a file of the first layout (head in w8a8), under the old name, is never what a load reads
    (cdir / "w4a8-cpu.safetensors").write_bytes((cdir / built[0]).read_bytes())
    monkeypatch.setitem(FORMATS, "w4a8", replace(FORMATS["w4a8"], revision=rev + 1))  # type: ignore[index]
    again = load_model(str(tiny_llama.path), dtype="w4a8", tokenizer=False).model
    assert (cdir / f"w4a8.r{rev + 1}-cpu.safetensors").is_file()  # rebuilt under the new name
    assert again.head.fmt == first.head.fmt == "q8a8"


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8", "w4a8"])
def test_a_draft_shares_the_unembedding_of_a_quantized_untied_target(tiny_llama, fmt):
    """A SPIRe draft reads the target's unembedding as floats, whatever format the head is in (w4a8's
    is in 8-bit groups, q8a8)."""
    from specstack.models.draft_file import shared_weights
    from specstack.models.loading import load_model

    target = load_model(str(tiny_llama.path), dtype=fmt, use_cache=False, tokenizer=False).model
    assert not target.config.tie_embeddings
    embed, head = shared_weights(target)
    assert head.shape == (target.config.vocab_size, target.config.d_model) and head.dtype == embed.dtype
    assert torch.equal(head, target.head.float_weight().to(embed.dtype))
    x = torch.randn(3, target.config.d_model).to(target.head.act_dtype)
    # the shared matrix is what the head multiplies by (up to the head's own activation rounding)
    assert torch.allclose(target.head(x).float(), x.float() @ head.float().t(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("fmt", ["w4a8", "w8a8"])
def test_a_cpu_only_format_is_refused_on_cuda(monkeypatch, tiny_llama, fmt):
    """Its kernels are CPU code: on CUDA only the float64 reference would run, row by row. Refused
    before anything is read or placed on the device."""
    from specstack.models.loading import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SpecstackError, match=f"{fmt} has no CUDA kernel.*bf16 or fp32 on cuda"):
        load_model(str(tiny_llama.path), dtype=fmt, device="cuda", use_cache=False, tokenizer=False)


def five_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q5a8's stored codes and d [N, K / 32] as GGUF Q5_0 holds them (d of either sign, an all-zero group)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) - 0.3) * 0.01
    d[0, 0] = 0.0
    return w4a8_codes.pack_codes5(codes), d


def test_five_bit_codes_pack_and_unpack_in_the_kernels_order():
    for k in (512, 96, 160, 224):  # whole chunks of 4 groups, and a last chunk of 3, 1 and 3 groups
        c = torch.randint(0, 32, (6, k), dtype=torch.uint8)
        packed = w4a8_codes.pack_codes5(c)
        assert packed.shape == (6, w4a8_codes.five_row_bytes(k // 32)) and torch.equal(w4a8_codes.unpack_codes5(packed), c)
    assert w4a8_codes.five_row_bytes(16) == 4 * 80 and w4a8_codes.five_row_bytes(5) == 80 + 32
    c = torch.randint(0, 32, (6, 512), dtype=torch.uint8)
    packed = w4a8_codes.pack_codes5(c)
    # a chunk: two little-endian 64-bit words of fifth bits, then the 4 groups' nibbles as pack_codes packs
    # them; bit p of the first word is code p % 16 of group p / 16, of the second code 16 + p % 16
    assert torch.equal(packed[:, 16:80], w4a8_codes.pack_codes(c[:, :128] & 15))
    words = packed[:, :16].view(6, 2, 8).to(torch.int64)
    lo, hi = (sum(words[:, h, b] << (8 * b) for b in range(8)) for h in (0, 1))
    top = (c[:, :128] >> 4).view(6, 4, 2, 16).to(torch.int64)
    for p in (0, 5, 21, 63):
        assert torch.equal((lo >> p) & 1, top[:, p // 16, 0, p % 16])
        assert torch.equal((hi >> p) & 1, top[:, p // 16, 1, p % 16])


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("k,n", [(896, 48), (4864, 96), (96, 40), (160, 24), (1536, 2048)])
def test_five_bit_groups_agree_with_the_reference_and_keep_rows_invariant(name, k, n):
    """q5a8 (GGUF Q5_0) on every path, whole chunks and a last chunk of 1 or 3 groups: against the
    reference and the dequantised matmul at every row count, and each row's numbers those it has alone."""
    packed, d = five_layer(k, n)
    run = {c.name: c for c in w4a8.KERNELS}[name].build("q5a8", packed, d, None)
    ref = w4a8.reference("q5a8", packed, d, None)
    w = w4a8.dequantize("q5a8", packed, d, None)
    x = inputs(33, k)
    alone = torch.cat([run(x[i : i + 1]) for i in range(33)])
    tol = tolerance(x, w)
    q, dx, _ = w4a8.quantize_groups(x)
    xq = (q.view(33, -1, 32).double() * dx.double()[..., None]).view(x.shape)
    for t in ROWS if k * n < 5_000_000 else ROWS[::3]:
        y = run(x[:t])
        assert torch.equal(y, alone[:t]), f"{name} {k}->{n}: {t} rows differ from the rows alone"
        assert ((y - ref(x[:t])).abs() <= tol[:t]).all(), f"{name} {k}->{n}, {t} rows: off the reference"
        want = (xq[:t] @ w.double().t()).float()
        assert ((y - want).abs() <= tol[:t]).all(), f"{name} {k}->{n}, {t} rows: off the dequantised matmul"


@pytest.mark.parametrize("name", KERNELS)
def test_five_bit_extreme_products_stay_exact(name):
    """Codes 0 and 31 (c - 16 = -16, 15) against activations at +-127, in whole chunks and a last chunk
    of one group: the integer sums at the format's largest, exact."""
    k, n = 1056, 8  # 33 groups
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[n // 2 :] = 31
    packed, d = w4a8_codes.pack_codes5(codes), torch.ones(n, k // 32)
    x = torch.ones(3, k)
    x[1] *= -1
    x[2, ::2] *= -1
    y = {c.name: c for c in w4a8.KERNELS}[name].build("q5a8", packed, d, None)(x)
    want = torch.tensor([-16.0 * k] * (n // 2) + [15.0 * k] * (n // 2))
    assert torch.equal(y[0], want) and torch.equal(y[1], -want) and torch.equal(y[2], torch.zeros(n))


def test_a_float_weight_into_five_bit_groups_stays_within_a_step():
    w = torch.randn(24, 512) * 0.05
    lin = QLinear(512, 24, "q5a8").set_float(w)
    assert ((lin.float_weight() - w).abs() <= lin.scales.abs().repeat_interleave(32, 1) / 2 + 1e-7).all()
    assert lin.step_bytes() == 24 * 512 * 5 // 8 + 24 * 16 * 4  # codes, fp32 d
    with pytest.raises(SpecstackError, match="divisible by 32"):
        QLinear(40, 8, "q5a8")


@native_only
@pytest.mark.parametrize("name", [k for k in KERNELS if k != "reference"])
def test_the_prefetch_distance_changes_speed_only(name):
    """The weight stream's software prefetch (set_prefetch) reads ahead of the codes, past a layer's last
    row too (a prefetch never faults): every layer format computes the same bits with it off, near and
    far, and a negative distance is refused."""
    x = inputs(5, 1536)
    c4, d4, m4 = layer(1536, 96)
    c8, d8, _ = layer(1536, 96, bits=8)
    runs = [kernel(name, c4, d4, m4), kernel(name, c8, d8, None)]
    default = torch.ops.specstack_w4a8.set_prefetch(0)
    try:
        off = [run(x) for run in runs]
        for bytes_ahead in (64, 8192, 1 << 20):
            torch.ops.specstack_w4a8.set_prefetch(bytes_ahead)
            assert all(torch.equal(run(x), y) for run, y in zip(runs, off, strict=True)), bytes_ahead
        with pytest.raises(RuntimeError, match="byte count"):
            torch.ops.specstack_w4a8.set_prefetch(-1)
    finally:
        torch.ops.specstack_w4a8.set_prefetch(default)
