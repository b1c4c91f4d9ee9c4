"""The *wide layout* of w4a8's layer formats: the same codes and scales as models/w4a8.py stores them,
rearranged once after load so that the AVX-512-VNNI matmuls put 16 outputs across a vector's lanes
(models/kernels/w4a8_wide.cpp says why: one float multiply-add per group for 16 outputs of a row, and
each weight unpacked once for 8 rows, so verifying 16 tokens costs about 2 one-token steps instead of 5).

A layer's tensors keep their shapes; only their order changes, in blocks of 16 outputs:
- codes: per block, per group of 32 inputs, 8 *quads* (inputs 4j .. 4j + 3) of 16 outputs x 4 codes.
  4-bit: 4 vectors of 64 bytes, byte (o, t) of vector j holding quad j's code (low nibble) and quad
  j + 4's (high nibble); 5-bit: those, then per quad a 64-bit mask of the fifth bits (bit 4 o + t);
  6-bit: the nibbles, then 2 vectors of top bits, bits 2f..2f+1 of byte (o, t) of vector h from quad
  4 h + f; 8-bit: 8 vectors of 64 signed codes, one per quad;
- scales, mins and super-block scales: output-minor ([.., 16] per block), so a group's 16 outputs are
  one vector; q5a8's and q8a8's group scales in fp16 where every one of a layer's is exact in it (a
  GGUF's Q5_0 and Q8_0 scales are fp16 in the file): the same numbers for 2 bytes a scale instead of 4,
  which a step of those layers streams (`HALF_SCALES`).
`to_wide` and `from_wide` are each other's inverse (tested): everything that reads a layer's numbers
(the reference, float weights, a head's kept rows, the built-model cache) reads them in the layers' own
layout through `from_wide`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specstack.models import w4a8_codes
from specstack.models.kernel_table import Kernel

LANES = 16  # outputs in a block
QUADS = 8  # vectors of 4 inputs in a group
WideTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# the layer formats whose scales (one per group, no mins) the wide layout keeps in fp16 where exact
HALF_SCALES = frozenset({"q5a8", "q8a8"})


def fits(layout: str, n: int, k: int) -> bool:
    """Whether a [n, k] layer of `layout` has a wide layout of the same shapes (whole blocks of 16 outputs;
    q5a8 also whole chunks of 4 groups, which its own layout pads otherwise)."""
    return n % LANES == 0 and (layout != "q5a8" or k % (4 * w4a8_codes.GROUP) == 0)


def _lanes(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[N, ...] per output -> per block of 16 outputs, the outputs last (or back): the same shape."""
    n = t.shape[0]
    flat = t.reshape(n // LANES, LANES, -1) if not inverse else t.reshape(n // LANES, -1, LANES)
    return flat.transpose(1, 2).reshape(t.shape).contiguous()


def _quads(c: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> [blocks, groups, 8 quads, 16 outputs, 4]."""
    n, k = c.shape
    return c.reshape(n // LANES, LANES, k // w4a8_codes.GROUP, QUADS, 4).permute(0, 2, 3, 1, 4)


def _from_quads(v: torch.Tensor) -> torch.Tensor:
    """The inverse of `_quads`: [blocks, groups, 8, 16, 4] -> codes [N, K]."""
    b, g = v.shape[:2]
    return v.permute(0, 3, 1, 2, 4).reshape(b * LANES, g * w4a8_codes.GROUP)


def _nibbles(c: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (their low 4 bits) -> [blocks, groups, 256] bytes: quad j low, quad j + 4 high."""
    v = _quads(c.to(torch.uint8) & 0x0F)
    return (v[:, :, :4] | v[:, :, 4:] << 4).reshape(*v.shape[:2], 256)


def _from_nibbles(raw: torch.Tensor) -> torch.Tensor:
    """[blocks, groups, 256] -> the low 4 bits of the codes [N, K]."""
    v = raw.reshape(*raw.shape[:2], 4, LANES, 4)
    return _from_quads(torch.cat([v & 0x0F, v >> 4], dim=2))


_BIT = 1 << torch.arange(8, dtype=torch.uint8)


def _codes_to(layout: str, stored: torch.Tensor) -> torch.Tensor:
    n = stored.shape[0]
    if layout == "q8a8":
        return _quads(stored).reshape(n, -1).contiguous()
    if layout in ("w4a8", "k4a8"):
        return _nibbles(w4a8_codes.unpack_codes(stored)).reshape(n, -1).contiguous()
    c = (w4a8_codes.unpack_codes6 if layout == "k6a8" else w4a8_codes.unpack_codes5)(stored)
    top = _quads(c >> 4)  # [b, g, 8, 16, 4]
    if layout == "k6a8":  # 2 vectors: field f of vector h from quad 4 h + f
        t = top.reshape(*top.shape[:2], 2, 4, LANES * 4)
        extra = (t[:, :, :, 0] | t[:, :, :, 1] << 2 | t[:, :, :, 2] << 4 | t[:, :, :, 3] << 6).reshape(*top.shape[:2], 128)
    else:  # a 64-bit mask a quad, bit 4 o + t, little-endian
        extra = (top.reshape(*top.shape[:2], QUADS, 8, 8) * _BIT).sum(dim=4, dtype=torch.uint8).reshape(*top.shape[:2], 64)
    return torch.cat([_nibbles(c), extra], dim=2).reshape(n, -1).contiguous()


def _codes_from(layout: str, wide: torch.Tensor, k: int) -> torch.Tensor:
    n = wide.shape[0]
    groups = k // w4a8_codes.GROUP
    if layout == "q8a8":
        return _from_quads(wide.reshape(n // LANES, groups, QUADS, LANES, 4)).contiguous()
    per = wide.reshape(n // LANES, groups, -1)
    low = _from_nibbles(per[:, :, :256])
    if layout in ("w4a8", "k4a8"):
        return w4a8_codes.pack_codes(low)
    if layout == "k6a8":
        planes = per[:, :, 256:].reshape(n // LANES, groups, 2, 1, LANES * 4)
        fields = (planes >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3
        top = _from_quads(fields.reshape(n // LANES, groups, QUADS, LANES, 4))
        return w4a8_codes.pack_codes6(low | top << 4)
    masks = per[:, :, 256:].reshape(n // LANES, groups, QUADS, 8, 1)
    top = _from_quads(((masks & _BIT) != 0).to(torch.uint8).reshape(n // LANES, groups, QUADS, LANES, 4))
    return w4a8_codes.pack_codes5(low | top << 4)


def _third_to(layout: str, extra: torch.Tensor | None) -> torch.Tensor | None:
    if extra is None:
        return None
    if layout == "k4a8":  # (sc, mn) [N, 2, G] -> per group the pair, then the lanes
        return _lanes(extra.transpose(1, 2)).reshape(extra.shape)
    return _lanes(extra)


def _third_from(layout: str, extra: torch.Tensor | None) -> torch.Tensor | None:
    if extra is None:
        return None
    if layout == "k4a8":
        n, _, groups = extra.shape
        return _lanes(extra.reshape(n, groups, 2), inverse=True).transpose(1, 2).contiguous()
    return _lanes(extra, inverse=True)


def _scales_to(layout: str, d: torch.Tensor) -> torch.Tensor:
    wide = _lanes(d)
    if layout in HALF_SCALES:
        half = wide.half()
        if torch.equal(half.float(), wide):  # every scale exact (NaN never is): the same numbers
            return half
    return wide


def to_wide(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None) -> WideTensors:
    """A layer's tensors (the layers' own layout) -> the wide layout, the same shapes (`fits` must hold);
    the scales fp16 where `HALF_SCALES` keeps them so."""
    return _codes_to(layout, stored), _scales_to(layout, d), _third_to(layout, extra)


def from_wide(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None, k: int) -> WideTensors:
    """The inverse of `to_wide`, for a layer of `k` inputs (the scales fp32 again)."""
    return _codes_from(layout, stored, k), _lanes(d.float(), inverse=True), _third_from(layout, extra)


def op_name(layout: str, suffix: str = "") -> str:
    """The qualified name of the op that runs `layout` in the wide layout (`suffix`: a path's, "_amx")."""
    return f"specstack_w4a8_wide::{w4a8_codes.OPS[layout]}{suffix}"


def kernel(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None, suffix: str = "") -> Kernel:
    """x [M, K] -> y [M, N] from a layer's tensors in the wide layout, by the path whose ops have `suffix`."""
    op: Callable[..., torch.Tensor] = getattr(torch.ops.specstack_w4a8_wide, w4a8_codes.OPS[layout] + suffix).default
    if extra is None:
        return lambda x: op(x.contiguous(), stored, d)
    return lambda x: op(x.contiguous(), stored, d, extra)


def padded_kernel(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None,
                  suffix: str = "") -> Kernel:
    """x [M, K] -> y [M, N] from a layer's tensors in its own layout, by a wide copy of them with the
    outputs padded to whole blocks (zero codes and scales): each output's numbers are those the layer
    would compute in place, whatever its output count (a kept subset of a head's rows, a small model)."""
    n = stored.shape[0]
    pad = -n % LANES

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    run = kernel(layout, *to_wide(layout, padded(stored), padded(d), None if extra is None else padded(extra)), suffix)
    return run if not pad else (lambda x: run(x)[:, :n].contiguous())
