"""Activations that probe a quantized kernel: rows of very different scales, an all-zero row,
outlier channels, and a run of values that round to exact halves (ties), shared by the format tests."""
from __future__ import annotations

import torch


def kernel_inputs(t: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 2, t)[:, None]  # rows of very different scales
    if t > 2:
        x[1] = 0.0  # an all-zero row
        x[2, :3] = 300.0  # outlier channels
        x[2, 40:64] = 0.5  # after scaling by the row's (or group's) max, exact halves: rounding ties
    return x
