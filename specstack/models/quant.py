"""Linear layers in six weight formats: fp32, bf16, weight-only int8 / int4, and the batch-invariant
w8a8 and w4a8.

int8: per-output-channel symmetric scales, torch's `_weight_int8pack_mm`.
int4: group-wise asymmetric (scale, zero) per 32 inputs, torch's `_weight_int4pack_mm_for_cpu` on CPU
      and `_weight_int4pack_mm` on CUDA; the kernels dequantise as w = (q - 8) * scale + zero.
      GGUF's Q4_1 blocks (w = d * q + m, 32 per block) map onto that directly: scale = d, zero = m + 8 d,
      so the 4-bit codes are packed without a detour through floats (exact up to the bf16 rounding of
      d and m + 8 d: the CPU kernel takes scales in the activation dtype).
w8a8: int8 codes with fp32 activations quantised per row at run time (models/w8a8.py): the
      batch-invariant format, whose rows compute the same numbers whatever else shares the forward.
w4a8: the GGUF's 4-bit codes with fp32 activations quantised per row and per group of 32 at run time
      (models/w4a8.py): batch-invariant too, and as close to the file as int4. Its wider layers (and its
      unembedding) take q8a8: 8-bit weight groups (GGUF Q8_0's layout) times the same activations; its
      Q4_K layers take k4a8: the same codes with Q4_K's super-block scales (fewer bytes, same numbers),
      its Q6_K layers k6a8: Q6_K's 6-bit codes and scales (6.625 bits a weight where q8a8 holds 9).
Activations are fp32 for fp32, w8a8 and w4a8 and bf16 for the others (`activation_dtype`).

Wide inputs: the int4/int8 kernels unpack every weight once per row block, so their cost grows with
the rows, and a prefill through them costs several times a bf16 matmul of the same weights
(docs/BENCHMARKS.md, "Wide forwards on dense weights"). int8 and int4 layers therefore also keep their
weight dequantised to the activation dtype (`dense`) and use it from `wide_rows` rows on: prefill, wide
trees and batches of rows run at matmul speed, the one-token step keeps the small format's bandwidth.
On a CPU without native bf16 (AVX2 only) a bf16 GEMM is emulated and slower than fp32, so there the
wide path multiplies in fp32 by a copy oneDNN has laid out for its GEMM once, faster still than a plain
fp32 matmul (docs/BENCHMARKS.md, "Batched decoding").
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specstack.errors import SpecstackError
from specstack.models import w4a8, w8a8
from specstack.models.bound import BoundModule, Forward
from specstack.models.kernel_table import LinearKernels


@dataclass
class Q4Weight:
    """4-bit codes with per-32 scale d and min m (w = d * q + m): GGUF Q4_0, Q4_1 and Q4_K blocks
    (models/gguf_quants.py), which the int4 format packs as they are. Q4_K's also keep the form d and m
    come from (`sup`, `sub`: d = D sc, m = M mn per super-block of 8 groups), which k4a8 stores."""

    q: torch.Tensor  # [out, in] uint8 in 0..15
    d: torch.Tensor  # [out, in // 32]
    m: torch.Tensor  # [out, in // 32]
    sup: torch.Tensor | None = None  # [out, in // 256, 2] fp32: (D, M)
    sub: torch.Tensor | None = None  # [out, 2, in // 32] uint8: (sc, mn)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.q.float().view(n, k // 32, 32) * self.d.float()[..., None] + self.m.float()[..., None]
        return g.view(n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def map_rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Q4Weight:
        """The same weight with its output rows moved by `f` (each tensor's first axis)."""
        return Q4Weight(f(self.q), f(self.d), f(self.m), None if self.sup is None else f(self.sup),
                        None if self.sub is None else f(self.sub))


@dataclass
class Q6Weight:
    """GGUF Q6_K's codes and scales (models/gguf_quants.py): w = D * s * (q - 32) with an int8 s per 16
    weights and D per 256, which the k6a8 format stores as they are."""

    q: torch.Tensor  # [out, in] uint8 in 0..63
    s: torch.Tensor  # [out, in // 16] int8
    d: torch.Tensor  # [out, in // 256] fp32 (D)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        unit = self.d.float().repeat_interleave(16, 1) * self.s.float()  # exact: an fp16 times an int8
        return (unit[..., None] * (self.q.float() - 32).view(n, k // 16, 16)).view(n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def map_rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Q6Weight:
        return Q6Weight(f(self.q), f(self.s), f(self.d))


CodedWeight = Q4Weight | Q6Weight  # a GGUF tensor's own codes, kept for the formats that store them


INT4_GROUP = 32
# Rows from which int8/int4 layers multiply by their dense copy on CPU, measured on the 2-core CPU for
# the default model's whole forwards (docs/BENCHMARKS.md, "Wide forwards on dense weights" and "The
# int8 crossover"): the int8 kernel works in blocks of 4 rows and costs twice as much from the 5th.
WIDE_ROWS: dict[str, int] = {"int8": 5, "int4": 10}
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


FP32_ACTIVATIONS = ("fp32", "w8a8", "w4a8", "q8a8", "k4a8", "k6a8")
# formats whose rows compute the same numbers whatever else shares the forward (and so does their
# attention: models/fixed_attention.py)
BATCH_INVARIANT = ("w8a8", "w4a8", "q8a8", "k4a8", "k6a8")
# the requested formats whose kernels are CPU code only (on CUDA only their float64 references would run:
# refused there, models/loading.py)
CPU_ONLY_FORMATS = ("w8a8", "w4a8")
# formats that take a GGUF tensor's codes as they are (`set_int4`, `set_int6`)
CODE_FORMATS = ("int4", "w4a8", "k4a8", "k6a8")
# a format's layout revision, raised whenever what its built models hold changes (the model cache
# names its files by it: models/loading.py). w4a8 r2: its wider layers and head in 8-bit groups;
# r3: its Q4_K layers in super-blocks (k4a8); r4: its Q6_K layers in 6-bit groups (k6a8).
FORMAT_REVISION: dict[str, int] = {"w4a8": 4}


# the batch-invariant formats' kernel tables (the path a process runs is its numbers' last bit)
KERNEL_TABLES: dict[str, Callable[[torch.device], LinearKernels]] = {"w4a8": w4a8.kernel_for, "w8a8": w8a8.kernel_for}


def weights_label(fmt: str, device: torch.device) -> str:
    """The weight format as a stats line names it: with its kernel path where it has a table of them."""
    table = KERNEL_TABLES.get(fmt)
    return fmt if table is None or device.type != "cpu" else f"{fmt} ({table(device).name} kernels)"


def six_bit_layers(fmt: str) -> bool:
    """Whether a model asked for in `fmt` may plan GGUF Q6_K layers as k6a8: under w4a8 only where this
    process's kernel path runs them fast (w4a8.six_bit_groups); no other format has k6a8 to plan."""
    return fmt != "w4a8" or w4a8.six_bit_groups()


def layout_variant(fmt: str) -> str:
    """What a built model's layout depends on besides its format's revision: whether its Q6_K layers
    are k6a8 or q8a8 (`six_bit_layers`)."""
    return "" if six_bit_layers(fmt) else "q8"


def activation_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt in FP32_ACTIVATIONS else torch.bfloat16


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: int values 0..15 of shape [N, K] -> the kernel's packed layout for q's device."""
    q = q.to(torch.int32)
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed, 8)


class QLinear(BoundModule):
    """y = x W^T (+ b) with W stored in one of the four formats (bound: see models/bound.py)."""

    # the buffers the formats register (register_buffer), declared for the type checker: a format
    # registers only its own (`scales` is absent in int4, `scales_zeros` outside it)
    weight: torch.Tensor  # floats, int8 codes, int4's packed layout, or w4a8's nibbles
    scales: torch.Tensor  # per row (int8, w8a8), per group of 32 (w4a8, q8a8), or (D, M) per 256 (k4a8)
    scales_zeros: torch.Tensor  # int4: [in / 32, out padded to 16, (scale, zero)]
    mins: torch.Tensor | None  # w4a8's group minimums (None in q8a8, k4a8 and k6a8)
    # k4a8's 6-bit (sc, mn) [out, 2, in / 32], k6a8's int8 scales [out, in / 16] (None elsewhere)
    subscales: torch.Tensor | None
    dense: torch.Tensor | None  # int8/int4: the dequantised copy wide inputs multiply by
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False,
                 device: torch.device | str | None = None, activation: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        n, k = out_features, in_features
        # int8/int4 kernels also take fp32 activations (and then return fp32)
        act = activation or activation_dtype(fmt)
        if fmt in ("fp32", "bf16", *BATCH_INVARIANT) and act != activation_dtype(fmt):
            raise ValueError(f"{fmt} weights compute in {activation_dtype(fmt)}")
        self.act_dtype = act
        if fmt in ("fp32", "bf16"):
            self.register_buffer("weight", torch.empty(n, k, dtype=act, device=device))
        elif fmt == "int8":
            self.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(n, dtype=act, device=device))
        elif fmt == "int4":
            if k % INT4_GROUP:
                raise SpecstackError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
            n = -(-n // 16) * 16  # the packing kernels need rows in multiples of 16: pad with zero rows
            packed = _pack_int4(torch.zeros(n, k, dtype=torch.int32, device=device))
            self.register_buffer("weight", packed)
            self.register_buffer("scales_zeros", torch.empty(k // INT4_GROUP, n, 2, dtype=act, device=device))
        elif fmt == "w8a8":
            self.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(n, dtype=torch.float32, device=device))
        elif fmt in ("w4a8", "q8a8"):
            if k % w4a8.GROUP:
                raise SpecstackError(f"{fmt} needs in_features divisible by {w4a8.GROUP}, got {k}")
            if fmt == "w4a8":
                self.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
            else:
                self.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))
            self.register_buffer("mins", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device)
                                 if fmt == "w4a8" else None)
        elif fmt == "k4a8":
            blk = w4a8.GROUP * w4a8.SUPER
            if k % blk:
                raise SpecstackError(f"k4a8 needs in_features divisible by {blk}, got {k}")
            self.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(n, k // blk, 2, dtype=torch.float32, device=device))
            self.register_buffer("subscales", torch.empty(n, 2, k // w4a8.GROUP, dtype=torch.uint8, device=device))
            self.register_buffer("mins", None)
        elif fmt == "k6a8":
            blk = w4a8.GROUP * w4a8.SUPER
            if k % blk:
                raise SpecstackError(f"k6a8 needs in_features divisible by {blk}, got {k}")
            self.register_buffer("weight", torch.empty(n, k * 3 // 4, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(n, k // blk, dtype=torch.float32, device=device))
            self.register_buffer("subscales", torch.empty(n, k // w4a8.SIX_SUB, dtype=torch.int8, device=device))
            self.register_buffer("mins", None)
        else:
            raise SpecstackError(f"unsupported weight format {fmt!r}; choose from fp32, bf16, int8, int4, w8a8, w4a8")
        if fmt not in ("k4a8", "k6a8"):
            self.register_buffer("subscales", None)
        quantized = fmt in ("int8", "int4")
        # the dequantised weight for wide inputs (see the module docstring). A persistent buffer, so the
        # built-model cache stores it: the packed int4 layout is opaque, and re-deriving the copy through
        # the kernel would cost seconds at every load (docs/BENCHMARKS.md, "Small costs behind the code's
        # choices")
        self._wide_rows: int | None = WIDE_ROWS.get(fmt)
        self.register_buffer("dense", torch.empty(out_features, k, dtype=act, device=device) if quantized else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=act, device=device) if bias else None)

    def step_bytes(self) -> int:
        """Bytes this layer's one-token kernel reads: the stored weight in its format, its scales and bias
        (not the dense copy, which only wide inputs read)."""
        parts = (self.weight, getattr(self, "scales", None), getattr(self, "scales_zeros", None),
                 getattr(self, "mins", None), getattr(self, "subscales", None), self.bias)
        return sum(t.nbytes for t in parts if t is not None)

    # -- construction -------------------------------------------------------------------------------
    @torch.no_grad()
    def set_float(self, w: torch.Tensor, b: torch.Tensor | None = None) -> QLinear:
        """Quantise a float weight [out, in] into this layer's format."""
        w = w.to(self.weight.device, torch.float32)
        act = self.act_dtype
        if self.fmt in ("fp32", "bf16"):
            self.weight.copy_(w)
        elif self.fmt == "int8":
            # round the scale to the stored dtype first, so codes are computed with the scale the
            # kernel will use (rounding up keeps |q| <= 127)
            scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(act)
            scale = torch.where(scale.float() * 127 < w.abs().amax(dim=1), torch.nextafter(scale, scale * 2), scale)
            self.weight.copy_((w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8))
            self.scales.copy_(scale)
            self._dense_copy().copy_(self.weight.float() * scale.float()[:, None])
        elif self.fmt == "w8a8":
            codes, scale = w8a8.quantize_weight(w)
            self.weight.copy_(codes)
            self.scales.copy_(scale)
        elif self.fmt == "w4a8":
            self._set_w4a8(*w4a8.quantize_weight(w))
        elif self.fmt == "k4a8":
            codes, sup, sub = w4a8.quantize_weight_k(w)
            self._set_k4a8(codes, sup, sub)
        elif self.fmt == "k6a8":
            codes, big, s16 = w4a8.quantize_weight6(w)
            self.set_int6(codes, s16, big)
        elif self.fmt == "q8a8":
            codes, d = w4a8.quantize_weight8(w)
            self.weight.copy_(codes)
            self.scales.copy_(d)
        else:
            n, k = w.shape
            g = w.view(n, k // INT4_GROUP, INT4_GROUP)
            lo, hi = g.amin(dim=2), g.amax(dim=2)
            # codes against the bf16-rounded (scale, zero) the kernel dequantises with
            d = ((hi - lo) / 15).clamp(min=1e-12).to(act).float()
            zero = (lo + 8 * d).to(act).float()
            q = ((g - zero[..., None]) / d[..., None] + 8).round().clamp(0, 15).view(n, k)
            self.set_int4(q, d, zero - 8 * d)
        if b is not None:
            if self.bias is None:
                raise ValueError("a bias given to a layer built without one (bias=False)")
            self.bias.copy_(b.to(self.bias.device, self.bias.dtype))
        self.unbind()  # a wide binding holds a copy of the weights (see bind)
        return self

    @torch.no_grad()
    def set_int4(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, sup: torch.Tensor | None = None,
                 sub: torch.Tensor | None = None) -> QLinear:
        """Set from 4-bit codes q [out, in] (0..15) with w = d * q + m per group of 32 (GGUF Q4_1), and for
        GGUF Q4_K also the super-blocks d and m come from (sup, sub: see Q4Weight). Exact for the int4,
        w4a8 and (given sup and sub) k4a8 formats; other formats receive the dequantised weight."""
        n, k = q.shape
        if self.fmt == "w4a8":  # the codes as they are, d and m in fp32 (exact for GGUF's fp16 and 6-bit scales)
            return self._set_w4a8(q, d.float(), m.float())
        if self.fmt == "k4a8":
            if sup is None or sub is None:
                raise ValueError("k4a8 takes 4-bit codes with their super-blocks (GGUF Q4_K)")
            return self._set_k4a8(q, sup.float(), sub)
        if self.fmt != "int4":
            w = (q.float().view(n, k // INT4_GROUP, INT4_GROUP) * d.float()[..., None]
                 + m.float()[..., None]).view(n, k)
            return self.set_float(w)
        dev = self.weight.device
        pad = self.scales_zeros.shape[1] - n
        if pad:  # zero rows: codes 8 with scale 0 and zero 0 dequantise to exactly 0
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype, device=q.device)])
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
            m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
        self.weight.copy_(_pack_int4(q.to(dev)))
        zero = m.float() + 8 * d.float()
        self.scales_zeros.copy_(torch.stack([d.float(), zero], dim=-1).transpose(0, 1).to(dev))
        # the dense copy from the stored (rounded) scale and zero, as the kernel dequantises
        scale, zero = (self.scales_zeros[..., i].t().float().repeat_interleave(INT4_GROUP, 1) for i in (0, 1))
        self._dense_copy().copy_(((q.to(dev).float() - 8) * scale + zero)[: self.out_features])
        self.unbind()  # a wide binding holds a copy of the weights (see bind)
        return self

    def set_int6(self, q: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> QLinear:
        """Set from GGUF Q6_K's codes q [out, in] (0..63), int8 scales s [out, in / 16] and D [out, in / 256]
        (see Q6Weight): kept as they are by k6a8, dequantised for every other format."""
        if self.fmt != "k6a8":
            return self.set_float(Q6Weight(q, s, d).dequantize())
        assert self.subscales is not None, "k6a8 registers its sub-block scales"
        self.weight.copy_(w4a8.pack_codes6(q.to(self.weight.device)))
        self.scales.copy_(d)
        self.subscales.copy_(s)
        self.unbind()
        return self

    def _set_w4a8(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QLinear:
        dev = self.weight.device
        self.weight.copy_(w4a8.pack_codes(q.to(dev)))
        self.scales.copy_(d)
        assert self.mins is not None, "w4a8 registers its group minimums"
        self.mins.copy_(m)
        self.unbind()
        return self

    def _set_k4a8(self, q: torch.Tensor, sup: torch.Tensor, sub: torch.Tensor) -> QLinear:
        dev = self.weight.device
        self.weight.copy_(w4a8.pack_codes(q.to(dev)))
        self.scales.copy_(sup)
        assert self.subscales is not None, "k4a8 registers its sub-block scales"
        self.subscales.copy_(sub)
        self.unbind()
        return self

    # -- use ----------------------------------------------------------------------------------------
    @property
    def wide_rows(self) -> int | None:
        return self._wide_rows

    @wide_rows.setter
    def wide_rows(self, rows: int | None) -> None:
        self._wide_rows = rows
        self.unbind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return super().forward(x)
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)

    def bind(self, bias: bool = True, wide: bool = True) -> Forward:
        """x [M, in] -> y [M, out]: the small format's kernel, or the dense copy from `wide_rows` rows."""
        b = self.bias if bias else None
        if self.fmt in ("fp32", "bf16"):
            w = self.weight
            return lambda x: F.linear(x, w, b)
        if self.fmt in BATCH_INVARIANT:  # the same kernel at every width: that is what keeps rows invariant
            if self.fmt == "w8a8":
                mm = w8a8.kernel_for(self.weight.device).build(self.weight, self.scales)
            else:  # one of w4a8's layer formats: its op takes the codes, scales and mins or sub-block scales
                mm = w4a8.kernel_for(self.weight.device).build(self.fmt, *self._w4a8_tensors())
            return mm if b is None else (lambda x: mm(x).add_(b))
        w, out = self.weight, self.out_features
        if self.fmt == "int8":
            s = self.scales
            small: Forward = lambda x: _INT8_MM(x, w, s)
        else:
            sz = self.scales_zeros
            mm = _INT4_MM_CPU if w.device.type == "cpu" else _INT4_MM
            small = (lambda x: mm(x, w, INT4_GROUP, sz)) if sz.shape[1] == out else \
                (lambda x: mm(x, w, INT4_GROUP, sz)[:, :out])  # padded rows
        quantized = small if b is None else (lambda x: small(x) + b)
        # the crossover is measured on CPU only; CUDA keeps the small format at every width (its int4
        # kernel stays efficient far wider, and the copy would read 4x the bytes in mid-width trees)
        rows = self._wide_rows if wide and w.device.type == "cpu" else None
        if rows is None:
            return quantized
        dense = self._dense_copy()
        if native_bf16():
            return lambda x: F.linear(x, dense, b) if x.shape[0] >= rows else quantized(x)
        # the fp32 copy laid out by oneDNN is made on the first wide call of this binding (a setter
        # unbinds, so it never outlives the weights), and not stored: the layout is opaque and
        # machine-specific, and a process that never runs a wide input never pays for it
        packed: list[torch.Tensor] = []
        b32 = None if b is None else b.float()
        act = self.act_dtype

        def wide_fp32(x: torch.Tensor) -> torch.Tensor:
            if not packed:
                w32 = dense.float()
                packed.append(torch.ops.mkldnn._reorder_linear_weight(w32, None) if _ONEDNN else w32)
            if _LINEAR_PACKED is None:
                return F.linear(x.float(), packed[0], b32).to(act)
            return _LINEAR_PACKED(x.float(), packed[0], b32, "none", [], "").to(act)

        return lambda x: wide_fp32(x) if x.shape[0] >= rows else quantized(x)

    def float_weight(self) -> torch.Tensor:
        """The weight as floats [out, in], without a forward: the stored floats, the dense copy, or the
        w8a8 codes times their scales."""
        if self.fmt in ("fp32", "bf16"):
            return self.weight
        if self.fmt == "w8a8":
            return self.weight.float() * self.scales[:, None]
        if self.fmt in w4a8.GROUP_FORMS:
            return w4a8.dequantize(self.fmt, *self._w4a8_tensors())
        return self._dense_copy()

    def _w4a8_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A w4a8 layer format's (codes, scales, mins or sub-block scales): a format registers one of the two."""
        return self.weight, self.scales, self.mins if self.mins is not None else self.subscales

    def _dense_copy(self) -> torch.Tensor:
        """int8/int4's dequantised copy (the formats that keep one)."""
        if self.dense is None:
            raise TypeError(f"a {self.fmt} layer keeps no dense copy")
        return self.dense

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] the small-format kernel computes with (for tests and conversions)."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.weight.device)
        return self.bind(bias=False, wide=False)(eye).float().t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"
