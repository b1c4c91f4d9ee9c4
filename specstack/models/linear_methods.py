"""How a layer in each weight format stores, fills and runs its weight: one method object per format
(vLLM's `LinearMethodBase`), named by the format's row in specstack/weight_formats.py.

A method registers the layer's tensors (`create`: persistent buffers, which is what the built-model cache
stores), fills them from floats (`set_float`) or from a GGUF tensor's own codes (`set_codes`, for the
formats that take codes; the others receive the codes dequantised), and builds the layer's forward
(`bind`). `QLinear` (models/quant.py) is the module around them and holds no format's knowledge.

Wide inputs (int8, int4): their kernels unpack every weight once per row block, so their cost grows
with the rows, and a prefill through them costs several times a bf16 matmul of the same weights
(docs/BENCHMARKS.md, "Wide forwards on dense weights"). Their rows therefore say from how many rows on
a layer multiplies by a dense copy of its weight (`WeightFormat.wide_rows`): prefill, wide trees and
batches of rows run at matmul speed, the one-token step keeps the small format's bandwidth. The copy is
resident beside the codes (QLinear.resident_bytes counts it; step_bytes does not) and not in the built-
model cache: a load derives it from the codes, a block of rows at a time (docs/BENCHMARKS.md, "The target
step (issue 48, third session)": a cache a third the size, a load 1.6 x longer). On a CPU without native bf16
(AVX2 only) a bf16 GEMM is emulated and slower than fp32, so there the wide path multiplies in fp32 by a
copy oneDNN has laid out for its GEMM once (docs/BENCHMARKS.md, "Batched decoding").
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from specstack.errors import SpecstackError
from specstack.models import quantizers, w4a8, w8a8
from specstack.models.bound import Forward
from specstack.models.coded import CodedWeight, Q4Weight, Q5Weight, Q6Weight
from specstack.models.kernel_table import LinearKernels
from specstack.weight_formats import WeightFormat, weight_format


class QLinear(Protocol):
    """What a method sees of its layer (models/quant.py's QLinear): the module its tensors are registered on."""

    weight: torch.Tensor
    scales: torch.Tensor
    scales_zeros: torch.Tensor
    mins: torch.Tensor
    subscales: torch.Tensor
    dense: torch.Tensor | None
    act_dtype: torch.dtype
    out_features: int

    @property
    def wide_rows(self) -> int | None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...

    def dequantized(self) -> torch.Tensor: ...

ACTIVATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INT4_GROUP = 32
# rows a dense copy is derived in at a time (a multiple of torch's int4 row blocks, so a block of packed
# rows unpacks on its own)
ROW_CHUNK = 1024
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4_MM_CPU = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm.default
_ONEDNN = torch.backends.mkldnn.is_available()
_LINEAR_PACKED = torch.ops.mkldnn._linear_pointwise.default if _ONEDNN else None


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 / AMX). Without it (AVX2), a bf16 GEMM
    is emulated and costs several times fp32 (docs/BENCHMARKS.md, "Batched decoding"): wide inputs
    then multiply in fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def activation_dtype(fmt: str) -> torch.dtype:
    """The dtype a format's layers take and return (the model around them computes in it)."""
    return ACTIVATION_DTYPES[weight_format(fmt).activation]


class LinearMethod:
    """One weight format's storage and forward. Subclasses register their tensors in `create` and
    say how to fill and run them; `spec` is the format's row of the table."""

    # the activation dtypes a layer may take besides the format's own (int8/int4's kernels take fp32 too)
    other_activations: tuple[torch.dtype, ...] = ()
    # the tensors a one-token forward reads, besides the bias (QLinear.step_bytes)
    step_tensors: tuple[str, ...] = ("weight",)
    # a format with several kernel paths: its table (models/kernel_table.py), one path chosen per process
    kernel_table: Callable[[torch.device], LinearKernels] | None = None

    def __init__(self, spec: WeightFormat) -> None:
        self.spec = spec

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        raise NotImplementedError

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        """Quantise a float weight [out, in] (fp32, on the layer's device) into the layer's tensors."""
        raise NotImplementedError

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        """A GGUF tensor's codes: stored as they are by the formats that take them, dequantised otherwise."""
        self.set_float(layer, coded.dequantize().to(layer.weight.device))

    def kernel(self, layer: QLinear) -> Forward:
        """x [M, in] -> y [M, out] without the bias, by the format's own kernel."""
        raise NotImplementedError

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        mm = self.kernel(layer)
        return mm if bias is None else (lambda x: mm(x) + bias)

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        """The weight as floats [out, in], as the kernel sees it, without a forward."""
        raise NotImplementedError

    def slow_layer_formats(self) -> frozenset[str]:
        """Layer formats a model asked for in this format plans as their `whole_only` instead in this
        process (its kernel path runs them slowly)."""
        return frozenset()

    def take_rows(self, layer: QLinear, out: QLinear, rows: torch.Tensor) -> None:
        """Fill `out` (a layer of this format with len(rows) outputs) with `layer`'s output rows `rows`:
        the very codes and scales. Here every stored tensor holds an output row per index of its first
        axis; a format whose layout does not says how instead."""
        for name in self.step_tensors:
            getattr(out, name).copy_(getattr(layer, name).index_select(0, rows))
        self.after_load(out)

    # -- the built-model cache: it stores what any CPU can load, a method repacks for the running one --
    def to_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Rewrite the layer's entries of a state dict being saved into the form the cache stores."""

    def from_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Rewrite the cache's form of the layer's entries, before they are loaded, into this CPU's layout."""

    def after_load(self, layer: QLinear) -> None:
        """Derive what the cache does not store (a dense copy) once the stored tensors are loaded."""


class FloatMethod(LinearMethod):
    """fp32 and bf16: the weight itself, torch's matmul."""

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=layer.act_dtype, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        layer.weight.copy_(w)

    def kernel(self, layer: QLinear) -> Forward:
        w = layer.weight
        return lambda x: F.linear(x, w)

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        w = layer.weight
        return lambda x: F.linear(x, w, bias)

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return layer.weight


class DenseCopyMethod(LinearMethod):
    """A format with a dense copy for wide inputs (int8, int4: see the module docstring)."""

    other_activations = (torch.float32,)

    def create_dense(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        # not persistent: the cache stores the codes only, and a load derives the copy (`after_load`)
        keep = self.spec.wide_rows is not None
        layer.register_buffer("dense", torch.empty(n, k, dtype=layer.act_dtype, device=device) if keep else None,
                              persistent=False)

    def after_load(self, layer: QLinear) -> None:
        self.fill_dense(layer)

    def rows_as_floats(self, layer: QLinear, start: int, end: int) -> torch.Tensor:
        """Output rows start..end of the weight in fp32 from the stored codes and scales, as the kernel
        dequantises them (`start` a multiple of ROW_CHUNK)."""
        raise NotImplementedError

    def fill_dense(self, layer: QLinear) -> None:
        """The copy from the weight the kernel computes with (its stored, rounded scales), a block of rows
        at a time: a whole layer's fp32 temporaries would cost more than the copy (the unembedding's:
        four bytes a weight), and a load makes one of these for every layer."""
        if layer.dense is None or layer.weight.device.type != "cpu":
            if layer.dense is not None:
                layer.dense.copy_(layer.dequantized())
            return
        n = layer.out_features
        for start in range(0, n, ROW_CHUNK):
            end = min(n, start + ROW_CHUNK)
            layer.dense[start:end].copy_(self.rows_as_floats(layer, start, end))

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        small = self.kernel(layer)
        quantized = small if bias is None else (lambda x: small(x) + bias)
        # the crossover is measured on CPU only; CUDA keeps the small format at every width (its int4
        # kernel stays efficient far wider, and the copy would read 4x the bytes in mid-width trees)
        rows = layer.wide_rows if wide and layer.weight.device.type == "cpu" else None
        dense = layer.dense
        if rows is None or dense is None:
            return quantized
        if native_bf16():
            return lambda x: F.linear(x, dense, bias) if x.shape[0] >= rows else quantized(x)
        # the fp32 copy laid out by oneDNN is made on the first wide call of this binding (a setter
        # unbinds, so it never outlives the weights), and not stored: the layout is opaque and
        # machine-specific, and a process that never runs a wide input never pays for it
        packed: list[torch.Tensor] = []
        b32 = None if bias is None else bias.float()
        act = layer.act_dtype

        def wide_fp32(x: torch.Tensor) -> torch.Tensor:
            if not packed:
                w32 = dense.float()
                packed.append(torch.ops.mkldnn._reorder_linear_weight(w32, None) if _ONEDNN else w32)
            if _LINEAR_PACKED is None:
                return F.linear(x.float(), packed[0], b32).to(act)
            return _LINEAR_PACKED(x.float(), packed[0], b32, "none", [], "").to(act)

        return lambda x: wide_fp32(x) if x.shape[0] >= rows else quantized(x)

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return layer.dense if layer.dense is not None else layer.dequantized()


class Int8Method(DenseCopyMethod):
    """int8 codes per output channel, torch's `_weight_int8pack_mm`."""

    step_tensors = ("weight", "scales")

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("scales", torch.empty(n, dtype=layer.act_dtype, device=device))
        self.create_dense(layer, n, k, device)

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, scale = quantizers.symmetric(w, None, 127, 1e-12 / 127, dtype=layer.act_dtype)
        layer.weight.copy_(codes.to(torch.int8))
        layer.scales.copy_(scale)
        self.fill_dense(layer)

    def rows_as_floats(self, layer: QLinear, start: int, end: int) -> torch.Tensor:
        return layer.weight[start:end].float() * layer.scales[start:end].float()[:, None]

    def kernel(self, layer: QLinear) -> Forward:
        w, s = layer.weight, layer.scales
        return lambda x: _INT8_MM(x, w, s)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: int values 0..15 of shape [N, K] -> the kernel's packed layout for q's device."""
    q = q.to(torch.int32)
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed, 8)


def _unpack_int4_cpu(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse of torch's CPU packing for rows blocked by `block`: [N, K / 2] uint8 -> codes [N, K]
    uint8. Each block of rows is [K, block / 2] bytes, byte d holding row d (low nibble) and row
    d + block / 2 (high); the last rows, fewer than a block, are [K, rows / 2], byte d rows 2 d and 2 d + 1."""
    n, half = packed.shape
    k = 2 * half
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    full = n // block * block
    if full:
        pp = packed[:full].reshape(full // block, k, block // 2)
        out[:full] = torch.cat([pp & 0x0F, pp >> 4], dim=2).permute(0, 2, 1).reshape(full, k)
    if n > full:
        pp = packed[full:].reshape(k, (n - full) // 2)
        out[full:] = torch.stack([pp & 0x0F, pp >> 4], dim=2).reshape(k, n - full).t()
    return out


@functools.cache
def _int4_block() -> int | None:
    """The row block of torch's CPU int4 packing in this process (it follows the CPU's vector width),
    found by packing a probe and checking the round trip; None: a layout this code does not know."""
    probe = torch.randint(0, 16, (3 * 64 + 16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = _pack_int4(probe)
    for block in (64, 32, 16):
        if torch.equal(_unpack_int4_cpu(packed, block).int(), probe):
            return block
    return None


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] of torch's CPU int4 layout (see `_unpack_int4_cpu`)."""
    block = _int4_block()
    if block is None:
        raise SpecstackError("this torch packs int4 weights in a layout specstack does not know; use --dtype int8 "
                             "or w4a8")
    return _unpack_int4_cpu(packed, block)


class Int4Method(DenseCopyMethod):
    """Group-wise asymmetric (scale, zero) per 32 inputs, torch's `_weight_int4pack_mm_for_cpu` on CPU and
    `_weight_int4pack_mm` on CUDA; the kernels dequantise as w = (q - 8) * scale + zero. GGUF's Q4 blocks
    (w = d * q + m per 32) map onto that directly: scale = d, zero = m + 8 d, so their codes are packed
    without a detour through floats (exact up to the bf16 rounding of d and m + 8 d: the CPU kernel takes
    scales in the activation dtype)."""

    step_tensors = ("weight", "scales_zeros")
    # the cache stores the codes as `w4a8.pack_codes` lays them out, the same [N, K / 2] bytes on every
    # CPU; torch's CPU layout blocks rows by the CPU's vector width, so a load repacks for its own CPU

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        if k % INT4_GROUP:
            raise SpecstackError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
        padded = -(-n // 16) * 16  # the packing kernels need rows in multiples of 16: pad with zero rows
        cpu = torch.device(device if device is not None else torch.get_default_device()).type != "cuda"
        # torch's CPU layout is [N, K / 2] bytes (filled by set_codes or a load; meta: the shape alone);
        # CUDA's has its own shape
        layer.register_buffer("weight", torch.empty(padded, k // 2, dtype=torch.uint8, device=device) if cpu else
                              _pack_int4(torch.zeros(padded, k, dtype=torch.int32, device=device)))
        layer.register_buffer("scales_zeros", torch.empty(k // INT4_GROUP, padded, 2, dtype=layer.act_dtype, device=device))
        self.create_dense(layer, n, k, device)

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        act = layer.act_dtype

        def stored(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # the (scale, zero) the kernel dequantises with, rounded to the activation dtype
            d = d.to(act).float()
            zero = (m + 8 * d).to(act).float()
            return d, zero - 8 * d

        q, d, m = quantizers.minmax(w, INT4_GROUP, 15, 1e-12, stored)
        self.set_codes(layer, Q4Weight(q.to(torch.uint8), d, m))

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q4Weight):
            return super().set_codes(layer, coded)
        q, d, m = coded.q, coded.d, coded.m
        n, k = q.shape
        dev = layer.weight.device
        pad = layer.scales_zeros.shape[1] - n
        if pad:  # zero rows: codes 8 with scale 0 and zero 0 dequantise to exactly 0
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype, device=q.device)])
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
            m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
        layer.weight.copy_(_pack_int4(q.to(dev)))
        zero = m.float() + 8 * d.float()
        layer.scales_zeros.copy_(torch.stack([d.float(), zero], dim=-1).transpose(0, 1).to(dev))
        self.fill_dense(layer)

    def rows_as_floats(self, layer: QLinear, start: int, end: int) -> torch.Tensor:
        q = unpack_int4(layer.weight[start : min(start + ROW_CHUNK, layer.weight.shape[0])])[: end - start]
        k = q.shape[1]
        scale, zero = (layer.scales_zeros[:, start:end, i].t().float()[..., None] for i in (0, 1))
        # the kernel's (q - 8) * scale + zero, operation for operation
        w = q.view(end - start, k // INT4_GROUP, INT4_GROUP).float().sub_(8).mul_(scale).add_(zero)
        return w.view(end - start, k)

    def take_rows(self, layer: QLinear, out: QLinear, rows: torch.Tensor) -> None:
        if layer.weight.device.type != "cpu":  # CUDA's packed layout: through floats
            return self.set_float(out, self.float_weight(layer).index_select(0, rows).float())
        q = unpack_int4(layer.weight).index_select(0, rows)
        sz = layer.scales_zeros.index_select(1, rows)
        pad = out.scales_zeros.shape[1] - rows.numel()
        if pad:  # zero rows, as set_codes pads
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
            sz = torch.cat([sz, sz.new_zeros(sz.shape[0], pad, 2)], dim=1)
        out.weight.copy_(_pack_int4(q))
        out.scales_zeros.copy_(sz)
        self.fill_dense(out)

    def to_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        if layer.weight.device.type == "cpu":
            state[prefix + "weight"] = torch.cat([w4a8.pack_codes(unpack_int4(part))
                                                  for part in layer.weight.split(ROW_CHUNK)])

    def from_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        stored = state.get(prefix + "weight")
        if layer.weight.device.type == "cpu" and stored is not None and stored.shape == layer.weight.shape:
            state[prefix + "weight"] = torch.cat([_pack_int4(w4a8.unpack_codes(part))
                                                  for part in stored.split(ROW_CHUNK)])

    def kernel(self, layer: QLinear) -> Forward:
        w, sz, out = layer.weight, layer.scales_zeros, layer.out_features
        mm = _INT4_MM_CPU if w.device.type == "cpu" else _INT4_MM
        if sz.shape[1] == out:
            return lambda x: mm(x, w, INT4_GROUP, sz)
        return lambda x: mm(x, w, INT4_GROUP, sz)[:, :out]  # padded rows


class W8A8Method(LinearMethod):
    """int8 codes per output channel times activations quantised per row at run time (models/w8a8.py)."""

    step_tensors = ("weight", "scales")
    kernel_table = staticmethod(w8a8.kernel_for)

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("scales", torch.empty(n, dtype=torch.float32, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, scale = w8a8.quantize_weight(w)
        layer.weight.copy_(codes)
        layer.scales.copy_(scale)

    def kernel(self, layer: QLinear) -> Forward:
        return w8a8.kernel_for(layer.weight.device).build(layer.weight, layer.scales)

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        mm = self.kernel(layer)  # the same kernel at every width: that is what keeps rows invariant
        return mm if bias is None else (lambda x: mm(x).add_(bias))

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return layer.weight.float() * layer.scales[:, None]


class GroupMethod(W8A8Method):
    """One of w4a8's layer formats (models/w4a8.py): codes in groups of 32 times activations quantised per
    row and group at run time; its op (w4a8.OPS) takes the codes, the scales and a third tensor (mins or
    sub-block scales) where the format has one."""

    third: str | None = None  # the name of the third tensor
    block = w4a8.GROUP  # in_features must be a multiple of it
    kernel_table = staticmethod(w4a8.kernel_for)

    @property
    def step_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("weight", "scales") + ((self.third,) if self.third else ())

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        if k % self.block:
            raise SpecstackError(f"{self.spec.name} needs in_features divisible by {self.block}, got {k}")
        self.create_tensors(layer, n, k, device)

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        raise NotImplementedError

    def tensors(self, layer: QLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return layer.weight, layer.scales, None if self.third is None else getattr(layer, self.third)

    def kernel(self, layer: QLinear) -> Forward:
        return w4a8.kernel_for(layer.weight.device).build(self.spec.name, *self.tensors(layer))

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return w4a8.dequantize(self.spec.name, *self.tensors(layer))


class W4A8Method(GroupMethod):
    """4-bit codes with an fp32 step and minimum per group (GGUF Q4_0, Q4_1 and Q4_K as they are)."""

    third = "mins"

    def slow_layer_formats(self) -> frozenset[str]:
        return w4a8.slow_layer_formats()

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))
        layer.register_buffer("mins", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        self.set_codes(layer, Q4Weight(*w4a8.quantize_weight(w)))

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q4Weight):
            return super().set_codes(layer, coded)
        # the codes as they are, d and m in fp32 (exact for GGUF's fp16 and 6-bit scales)
        layer.weight.copy_(w4a8.pack_codes(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d.float())
        layer.mins.copy_(coded.m.float())


class Q8A8Method(GroupMethod):
    """8-bit codes with an fp32 scale per group (GGUF Q8_0's layout): w4a8's wider layers and its head."""

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, d = w4a8.quantize_weight8(w)
        layer.weight.copy_(codes)
        layer.scales.copy_(d)


class Q5A8Method(GroupMethod):
    """GGUF Q5_0's 5-bit codes with an fp32 scale per 32: w = d (c - 16)."""

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        groups = k // w4a8.GROUP
        layer.register_buffer("weight", torch.empty(n, w4a8.five_row_bytes(groups), dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, groups, dtype=torch.float32, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        self.set_codes(layer, Q5Weight(*w4a8.quantize_weight5(w)))

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q5Weight):
            raise ValueError("q5a8 takes 5-bit codes with their scales (GGUF Q5_0)")
        layer.weight.copy_(w4a8.pack_codes5(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d.float())


class K4A8Method(GroupMethod):
    """GGUF Q4_K's codes with its super-block scales: (D, M) fp32 per 256, 6-bit (sc, mn) per 32."""

    third = "subscales"
    block = w4a8.GROUP * w4a8.SUPER

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // self.block, 2, dtype=torch.float32, device=device))
        layer.register_buffer("subscales", torch.empty(n, 2, k // w4a8.GROUP, dtype=torch.uint8, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, sup, sub = w4a8.quantize_weight_k(w)
        self.set_codes(layer, Q4Weight(codes, *w4a8.expand_scales(sup, sub), sup, sub))

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q4Weight) or coded.sup is None or coded.sub is None:
            raise ValueError("k4a8 takes 4-bit codes with their super-blocks (GGUF Q4_K)")
        layer.weight.copy_(w4a8.pack_codes(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.sup.float())
        layer.subscales.copy_(coded.sub)


class K6A8Method(GroupMethod):
    """GGUF Q6_K's 6-bit codes with an int8 scale per 16 and D per 256."""

    third = "subscales"
    block = w4a8.GROUP * w4a8.SUPER

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k * 3 // 4, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // self.block, dtype=torch.float32, device=device))
        layer.register_buffer("subscales", torch.empty(n, k // w4a8.SIX_SUB, dtype=torch.int8, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, big, s16 = w4a8.quantize_weight6(w)
        self.set_codes(layer, Q6Weight(codes, s16, big))

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q6Weight):
            raise ValueError("k6a8 takes 6-bit codes with their scales (GGUF Q6_K)")
        layer.weight.copy_(w4a8.pack_codes6(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d)
        layer.subscales.copy_(coded.s)


@functools.cache
def method_for(fmt: str) -> LinearMethod:
    """The method object of a format's row (weight_formats.FORMATS), its class imported on first use."""
    spec = weight_format(fmt)
    module, _, name = spec.method.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(spec)
