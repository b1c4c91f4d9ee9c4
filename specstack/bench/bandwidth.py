"""The physical limit of a decode step (issue: flat-cost forward): this machine's memory bandwidth,
measured as a large copy, and the bytes a one-token step of a model reads, so every forward time can
stand beside its floor (bytes / bandwidth).

Bandwidth: the best of a few copies of a buffer far larger than any cache, counted as STREAM's copy
counts it (bytes read + bytes written). A step's bytes: every linear layer's stored weights in their
format with their scales and biases (QLinear.step_bytes), and one row of the embedding; norms and the
KV cache are left out (the first is a few KB, the second depends on the context)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specstack.models.base import LoadedModel
from specstack.models.quant import QLinear

COPY_BYTES = 2**30  # each of the two buffers: past the L3 of the machines we run on (up to 480 MiB seen)


def measure_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a large memory-to-memory copy (read + write), best of `repeats`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page once before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def step_bytes(lm: LoadedModel) -> int:
    """Bytes a one-token forward of the model reads from its weights."""
    model = lm.model
    linear = sum(m.step_bytes() for m in model.modules() if isinstance(m, QLinear))
    embed = getattr(model, "embed", None)
    return linear + (embed[0].nbytes if embed is not None else 0)


@dataclass(frozen=True)
class StepLimit:
    fmt: str
    bytes: int
    limit_ms: float  # bytes / bandwidth


def step_limits(models: dict[str, LoadedModel], bandwidth: float) -> list[StepLimit]:
    limits = []
    for fmt, lm in models.items():
        nbytes = step_bytes(lm)
        limits.append(StepLimit(fmt, nbytes, 1e3 * nbytes / bandwidth))
    return limits


def limit_table(limits: list[StepLimit], t1_ms: dict[str, float], bandwidth: float) -> str:
    """Per format: the bytes a step reads, its floor at the measured bandwidth, and the measured
    one-token forward (t1_ms, by format) against that floor."""
    lines = [f"| format | bytes a one-token step reads | floor at {bandwidth / 1e9:.1f} GB/s (ms) | "
             "measured T = 1 (ms) | measured / floor |", "|---|---:|---:|---:|---:|"]
    for lim in limits:
        ms = t1_ms.get(lim.fmt)
        measured = f"{ms:.1f} | {ms / lim.limit_ms:.2f}" if ms is not None else "– | –"
        lines.append(f"| {lim.fmt} | {lim.bytes / 1e6:.1f} MB | {lim.limit_ms:.2f} | {measured} |")
    return "\n".join(lines)
