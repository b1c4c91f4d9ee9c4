"""The two ways a float weight becomes codes, written once for every format that quantises floats:
symmetric (a scale per group, codes -levels..levels: int8, w8a8, q8a8) and min/max (a step and a minimum
per group, codes 0..levels: int4, w4a8). GGUF files bring their own codes; these serve float sources
(Hugging Face checkpoints, GGUF float tensors, trained drafts) and the layers a file's types do not fit.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

ScaleRounding = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _groups(w: torch.Tensor, group: int | None) -> torch.Tensor:
    n, k = w.shape
    size = k if group is None else group
    return w.float().view(n, k // size, size)


def symmetric(w: torch.Tensor, group: int | None, levels: int, tiny: float,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes [N, K] as integer floats in [-levels, levels], scales [N, K / group]
    or [N] when `group` is None): each group's largest magnitude at `levels` steps, the scale at least
    `tiny` (an all-zero group). `dtype`: the scale is stored in it, rounded up where rounding would put
    the largest weight past the last code, and the codes are taken against the stored scale."""
    g = _groups(w, group)
    amax = g.abs().amax(dim=2)
    scale = (amax / levels).clamp(min=tiny)
    if dtype is not None:
        stored = scale.to(dtype)
        scale = torch.where(stored.float() * levels < amax, torch.nextafter(stored, stored * 2), stored)
    codes = (g / scale.float()[..., None]).round().clamp(-levels, levels)
    return codes.view(w.shape), scale if group is not None else scale[:, 0]


def minmax(w: torch.Tensor, group: int, levels: int, tiny: float,
           rounding: ScaleRounding | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes [N, K] as integer floats in 0..levels, d, m [N, K / group]) with
    w ~ d c + m: each group's range in `levels` steps from its minimum. `rounding` maps (d, m) to the
    values a kernel will use (a format's stored precision), and the codes are taken against those."""
    g = _groups(w, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d = ((hi - lo) / levels).clamp(min=tiny)
    m = lo
    if rounding is not None:
        d, m = rounding(d, m)
    codes = ((g - m[..., None]) / d[..., None]).round().clamp(0, levels)
    return codes.view(w.shape), d, m
