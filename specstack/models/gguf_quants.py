"""GGUF quant types as a table: what each type's blocks become in each weight format (DESIGN §3).

The int4 kernels compute w = (q - 8) * scale + zero per group of 32 inputs. Three GGUF types are that
layout already, so their 4-bit codes are packed as they are (`Q4Weight`), without a detour through
floats; the only change is the kernel's bf16 rounding of each group's scale and zero:
- Q4_0: w = d * (q - 8) per 32: scale d, zero 0.
- Q4_1: w = d * q + m per 32: scale d, zero m + 8 d.
- Q4_K: super-blocks of 256 under (d, dmin), each 32-weight sub-block with a 6-bit scale sc and min mn:
  w = d sc q - dmin mn, so a sub-block is a Q4_1 group with d' = d sc, m' = -dmin mn.
The w4a8 format takes the same codes (models/w4a8.py keeps d and m in fp32, so they are exact), and
Q4_K's with their super-block form (the layer format k4a8: D, M per 256, sc and mn per 32).
- Q6_K: w = d * s * (q - 32), q in 0..63, an int8 s per 16 weights, d per 256: w4a8 keeps it as it is
  (the layer format k6a8), its 6-bit codes and scales (`Q6Weight`).
- Q5_0: w = d * (q - 16), q in 0..31, d per 32: w4a8 keeps it as it is (the layer format q5a8, `Q5Weight`).
Every other type (Q5_1, Q5_K, Q8_0, the rest gguf can dequantise, and Q5_0 and Q6_K under int4) holds
more than 4 bits of precision, so the int4 format gives its layers int8 (per output channel), and
w4a8 gives them its 8-bit groups (q8a8): more bytes than int4, far less error than requantising 5-8
bits into 4 (docs/bench-history, "Quant types", measures each choice). bf16 and fp32 take every type
dequantised. A fused layer (q|k|v, gate|up) takes the widest format any of its parts needs; a format
only its own type fills (k6a8, q5a8) gives way to q8a8 when the other parts are of another type, and
where the kernel path runs it slowly (w4a8.NARROW_PATHS).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specstack.models.coded import CodedWeight, Q4Weight, Q5Weight, Q6Weight
from specstack.weight_formats import FORMATS, widest


def _fp16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 stored as 2 uint8 along the last axis -> float32 (drops that axis)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _q4_0(blocks: np.ndarray, rows: int, cols: int) -> Q4Weight:
    b = blocks.reshape(rows, cols // 32, 18)
    d, qs = _fp16(b[..., 0:2]), b[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles first
    return _q4(q, d, -8 * d)


def _q4_1(blocks: np.ndarray, rows: int, cols: int) -> Q4Weight:
    b = blocks.reshape(rows, cols // 32, 20)
    d, m, qs = _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return _q4(q, d, m)


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> Q4Weight:
    b = blocks.reshape(rows, cols // 256, 144)
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # [rows, S]
    s = b[..., 4:16].reshape(rows, cols // 256, 3, 4)  # the 12 bytes of eight 6-bit (scale, min) pairs
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [rows, S, 8]
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = b[..., 16:144].reshape(rows, cols // 256, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)  # sub-block 2c = low, 2c + 1 = high
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, cols // 32)
    zero_m = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, cols // 32)
    w = _q4(q, scale, zero_m)
    # the form d and m come from, which k4a8 keeps (3 bytes of scales a group instead of 8)
    w.sup = torch.from_numpy(np.ascontiguousarray(np.stack([d, -dmin], axis=-1), dtype=np.float32))
    w.sub = torch.from_numpy(np.ascontiguousarray(np.stack([sc.reshape(rows, -1), mn.reshape(rows, -1)], axis=1),
                                                  dtype=np.uint8))
    return w


def _q6_k(blocks: np.ndarray, rows: int, cols: int) -> Q6Weight:
    """Q6_K's blocks of 256 (210 bytes: ql[128] low nibbles, qh[64] top 2 bits, int8 scales[16], fp16 d),
    two halves of 128: weight l + 32 j of a half (l < 32, j < 4) takes nibble j // 2 of ql[l + 32 (j % 2)]
    and bits 2 j, 2 j + 1 of qh[l]; weight p of the block the scale p // 16."""
    b = blocks.reshape(rows, cols // 256, 210)
    ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [.., half, j % 2, l]
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=3)
    top = np.concatenate([(qh >> (2 * j)) & 3 for j in range(4)], axis=3)  # [.., half, j, l]
    q = (low | (top << 4)).reshape(rows, cols)
    s = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(rows, cols // 16)
    return Q6Weight(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)), torch.from_numpy(s.copy()),
                    torch.from_numpy(np.ascontiguousarray(_fp16(b[..., 208:210]))))


def _q5_0(blocks: np.ndarray, rows: int, cols: int) -> Q5Weight:
    """Q5_0's blocks of 32 (22 bytes: fp16 d, a 32-bit word of fifth bits qh, 16 bytes of nibbles qs):
    weight j takes the low nibble of qs[j] (j < 16) or the high one of qs[j - 16], and bit j of qh."""
    b = blocks.reshape(rows, cols // 32, 22)
    d, qs = _fp16(b[..., 0:2]), b[..., 6:22]
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [rows, groups, 1]
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (fifth << 4)
    return Q5Weight(torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols), dtype=np.uint8)), torch.from_numpy(d))


def _q4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> Q4Weight:
    return Q4Weight(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)), torch.from_numpy(d), torch.from_numpy(m))


@dataclass(frozen=True)
class QuantType:
    """One GGUF tensor type: the layer format it gives in each requested format, and its codes for the
    formats that store them as they are (weight_formats: `takes_codes`)."""

    name: str
    formats: Mapping[str, str]  # requested weight format -> the format its layers get
    codes: Any = None  # (blocks, rows, cols) -> its CodedWeight

    def format_for(self, requested: str) -> str:
        return self.formats.get(requested, requested)


_SAME = {"int4": "int4", "w4a8": "w4a8", "int8": "int8", "bf16": "bf16", "fp32": "fp32"}
# Q4_K under w4a8: its codes with its own super-block scales (k4a8, models/w4a8.py)
_SUPER = {**_SAME, "w4a8": "k4a8"}
# w4a8's wider layers take its 8-bit groups (q8a8, models/w4a8.py): batch-invariant too
_WIDE = {"int4": "int8", "w4a8": "q8a8", "int8": "int8", "bf16": "bf16", "fp32": "fp32"}
# Q6_K under w4a8 (its head too, which w4a8 asks in q8a8): its own codes and scales (k6a8, models/w4a8.py)
_SIX = {**_WIDE, "w4a8": "k6a8", "q8a8": "k6a8"}
# Q5_0 under w4a8: its own 5-bit codes and scales (q5a8, models/w4a8.py)
_FIVE = {**_WIDE, "w4a8": "q5a8", "q8a8": "q5a8"}
QUANT_TYPES: Mapping[str, QuantType] = {
    q.name: q for q in (
        QuantType("F32", _SAME), QuantType("F16", _SAME), QuantType("BF16", _SAME),
        QuantType("Q4_0", _SAME, _q4_0), QuantType("Q4_1", _SAME, _q4_1), QuantType("Q4_K", _SUPER, _q4_k),
        QuantType("Q5_0", _FIVE, _q5_0), QuantType("Q5_1", _WIDE), QuantType("Q5_K", _WIDE), QuantType("Q6_K", _SIX, _q6_k),
        QuantType("Q8_0", _WIDE),
    )
}
OTHER = QuantType("other", _WIDE)  # any other type gguf dequantises (Q2_K, Q3_K, IQ*): never requantised to 4 bits


def quant_type(name: str) -> QuantType:
    return QUANT_TYPES.get(name, OTHER)


def layer_format(requested: str, part_types: list[str], slow: frozenset[str] = frozenset()) -> str:
    """The format of a layer built from parts of these GGUF types (or "F32" for a float source), when
    the model is asked for `requested`: the widest any part needs. slow: layer formats this process's
    kernel path runs slowly (w4a8.slow_layer_formats): their `whole_only` format instead."""
    wants = {quant_type(t).format_for(requested) for t in part_types}
    if len(wants) > 1 or wants & slow:  # a format only its own type fills (whole_only) gives way
        wants = {FORMATS[f].whole_only or f for f in wants}
    return widest(wants)


def read_tensor(t: Any, want_codes: bool) -> CodedWeight | torch.Tensor:
    """One GGUF tensor as [rows, cols] (or [cols]): its codes when `want_codes` and the type has a
    reader of them (`QuantType.codes`), else dequantised to fp32."""
    import gguf

    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    cols = int(t.shape[0])
    codes = QUANT_TYPES.get(t.tensor_type.name, OTHER).codes
    if want_codes and codes is not None:
        return codes(np.asarray(t.data, dtype=np.uint8), rows, cols)
    floats = gguf.quants.dequantize(t.data, t.tensor_type)
    w = torch.from_numpy(np.array(floats, dtype=np.float32, order="C"))  # a writable copy: GGUF data is a read-only map
    return w.reshape(rows, cols) if len(t.shape) > 1 else w.reshape(cols)
