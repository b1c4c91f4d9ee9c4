"""A GGUF tensor's own codes, for the formats that store them as they are (models/gguf_quants.py reads
them; models/linear_methods.py stores them)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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


@dataclass
class Q5Weight:
    """GGUF Q5_0's codes and scales (models/gguf_quants.py): w = d * (q - 16) with d per 32 weights, which
    the q5a8 format stores as they are."""

    q: torch.Tensor  # [out, in] uint8 in 0..31
    d: torch.Tensor  # [out, in // 32] fp32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return ((self.q.float() - 16).view(n, k // 32, 32) * self.d.float()[..., None]).view(n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def map_rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Q5Weight:
        return Q5Weight(f(self.q), f(self.d))


CodedWeight = Q4Weight | Q5Weight | Q6Weight  # a GGUF tensor's own codes, kept for the formats that store them


def concat(parts: list[CodedWeight]) -> CodedWeight | None:
    """The output rows of several coded weights of one kind as one (a fused layer's parts), or None when
    they are not all of one kind (or Q4_K's super-blocks are on some only): the layer then takes floats."""
    kind = type(parts[0])
    if not all(type(p) is kind for p in parts):
        return None
    fields = [f for f in kind.__dataclass_fields__ if all(getattr(p, f) is not None for p in parts)]
    return kind(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))
