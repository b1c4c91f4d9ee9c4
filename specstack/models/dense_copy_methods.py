"""The weight formats on torch's own kernels, int8 (per output channel) and int4 (per group of 32), and
their policy for wide inputs (methods of models/linear_methods.py).

Wide inputs: these kernels unpack every weight once per row block, so their cost grows with the rows,
and a prefill through them costs several times a bf16 matmul of the same weights (docs/bench-history,
"Wide forwards on dense weights"). Their rows therefore say from how many rows on a layer multiplies by a
dense copy of its weight (`WeightFormat.wide_rows`): prefill, wide trees and batches of rows run at
matmul speed, the one-token step keeps the small format's bandwidth. The copy is resident beside the
codes (QLinear.resident_bytes counts it; step_bytes does not) and not in the built-model cache: a load
derives it from the codes, a block of rows at a time (docs/bench-history, "The target step (issue 48,
third session)": a cache a third the size, a load 1.6 x longer). On a CPU without native bf16 (AVX2 only)
a bf16 GEMM is emulated and slower than fp32, so there the wide path multiplies in fp32 by a copy oneDNN
has laid out for its GEMM once (docs/bench-history, "Batched decoding").
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specstack.errors import SpecstackError
from specstack.models import quantizers, w4a8_codes
from specstack.models.bound import Forward
from specstack.models.coded import CodedWeight, Q4Weight
from specstack.models.linear_methods import LinearMethod, QLinear, native_bf16

INT4_GROUP = 32
# rows a dense copy is derived in at a time (a multiple of torch's int4 row blocks, so a block of packed
# rows unpacks on its own)
ROW_CHUNK = 1024
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4_MM_CPU = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm.default
_ONEDNN = torch.backends.mkldnn.is_available()
_LINEAR_PACKED = torch.ops.mkldnn._linear_pointwise.default if _ONEDNN else None


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
    # the cache stores the codes as `w4a8_codes.pack_codes` lays them out, the same [N, K / 2] bytes on every
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
            state[prefix + "weight"] = torch.cat([w4a8_codes.pack_codes(unpack_int4(part))
                                                  for part in layer.weight.split(ROW_CHUNK)])

    def from_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        stored = state.get(prefix + "weight")
        if layer.weight.device.type == "cpu" and stored is not None and stored.shape == layer.weight.shape:
            state[prefix + "weight"] = torch.cat([_pack_int4(w4a8_codes.unpack_codes(part))
                                                  for part in stored.split(ROW_CHUNK)])

    def kernel(self, layer: QLinear) -> Forward:
        w, sz, out = layer.weight, layer.scales_zeros, layer.out_features
        mm = _INT4_MM_CPU if w.device.type == "cpu" else _INT4_MM
        if sz.shape[1] == out:
            return lambda x: mm(x, w, INT4_GROUP, sz)
        return lambda x: mm(x, w, INT4_GROUP, sz)[:, :out]  # padded rows
