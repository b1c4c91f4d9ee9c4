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


def measure_read_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes per second read from a large buffer (a sum over it: reads only, as a decode step's weights
    are), best of `repeats`. A step reads its weights and writes almost nothing, so this is its floor's
    bandwidth; the copy's (read + write) is kept beside it as earlier runs reported it."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()  # touch every page once before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def step_bytes(lm: LoadedModel) -> int:
    """Bytes a one-token forward of the model reads from its weights."""
    model = lm.model
    linear = sum(m.step_bytes() for m in model.modules() if isinstance(m, QLinear))
    embed = getattr(model, "embed", None)
    return linear + (embed[0].nbytes if embed is not None else 0)


def resident_bytes(lm: LoadedModel) -> int:
    """Bytes the model holds: every tensor of it once, dense copies for wide inputs included
    (QLinear.resident_bytes for a layer's share)."""
    tensors = {t.data_ptr(): t.nbytes for t in (*lm.model.parameters(), *lm.model.buffers()) if t.numel()}
    return sum(tensors.values())


@dataclass(frozen=True)
class StepLimit:
    fmt: str
    bytes: int
    limit_ms: float  # bytes / bandwidth (the copy's)
    read_limit_ms: float | None = None  # bytes / read bandwidth
    resident: int | None = None  # bytes the model holds (resident_bytes)


def step_limits(models: dict[str, LoadedModel], bandwidth: float, read_bandwidth: float | None = None
                ) -> list[StepLimit]:
    limits = []
    for fmt, lm in models.items():
        nbytes = step_bytes(lm)
        read = None if read_bandwidth is None else 1e3 * nbytes / read_bandwidth
        limits.append(StepLimit(fmt, nbytes, 1e3 * nbytes / bandwidth, read, resident_bytes(lm)))
    return limits


def limit_table(limits: list[StepLimit], t1_ms: dict[str, float], bandwidth: float,
                read_bandwidth: float | None = None) -> str:
    """Per format: the bytes a step reads, its floor at the measured bandwidth (copy, and read where
    measured), and the measured one-token forward (t1_ms, by format) against that floor."""
    read = read_bandwidth is not None and all(lim.read_limit_ms is not None for lim in limits)
    head = f"| format | bytes a one-token step reads | floor at {bandwidth / 1e9:.1f} GB/s copy (ms) | "
    head += f"floor at {read_bandwidth / 1e9:.1f} GB/s read (ms) | " if read and read_bandwidth else ""
    held = all(lim.resident is not None for lim in limits)
    lines = [head + "measured T = 1 (ms) | measured / floor |" + (" measured / read floor |" if read else "")
             + (" resident (MB) |" if held else ""),
             "|---|---:|---:|" + ("---:|" if read else "") + "---:|---:|" + ("---:|" if read else "") + ("---:|" if held else "")]
    for lim in limits:
        ms = t1_ms.get(lim.fmt)
        floors = f"{lim.limit_ms:.2f}" + (f" | {lim.read_limit_ms:.2f}" if read else "")
        if ms is None:
            measured = "– | –" + (" | –" if read else "")
        else:
            measured = f"{ms:.1f} | {ms / lim.limit_ms:.2f}"
            if read and lim.read_limit_ms:
                measured += f" | {ms / lim.read_limit_ms:.2f}"
        resident = f" {lim.resident / 1e6:.1f} |" if held and lim.resident is not None else ""
        lines.append(f"| {lim.fmt} | {lim.bytes / 1e6:.1f} MB | {floors} | {measured} |{resident}")
    return "\n".join(lines)
