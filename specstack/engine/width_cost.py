"""What a target forward costs as a function of how many tokens it scores (the verification width).

A cost-aware draft length (drafting/draft_length.py) needs this curve, and it is a property of the
machine, the weight format and the thread count, not something to assume: on an int4 CPU target it
is a step function (blocks of four rows in the int4 kernel), on a bf16 one nearly flat. So it is
measured, once per loaded target: chain forwards of T = 1 .. n tokens over a committed context,
interleaved across widths (drift hits all widths alike), median per width, made non-decreasing (a
wider forward never costs less; the median of a few noisy samples sometimes says so).
"""
from __future__ import annotations

import statistics
import time

import torch

from specstack.models.loading import LoadedModel


def measure_width_costs(lm: LoadedModel, widths: int, context: int = 256, repeats: int = 5,
                        warmup: int = 1) -> list[float]:
    """Seconds of a target forward over T = 1 .. `widths` tokens after `context` committed ones."""
    from specstack.bench.forward import (  # the benchmark's scratch-only forward
        context_ids,
        ours_forward_steps,
    )

    if widths < 1 or repeats < 1:
        raise ValueError(f"need widths >= 1 and repeats >= 1, got {widths}, {repeats}")
    cfg = lm.config
    ctx = context_ids(None, max(1, min(context, cfg.max_seq_len - widths)), cfg.vocab_size)
    chain = ours_forward_steps(lm, ctx, widths)[f"specstack {lm.fmt} chain"]
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, cfg.vocab_size, (1, t), generator=gen).to(lm.model.device) for t in range(1, widths + 1)]
    times: list[list[float]] = [[] for _ in blocks]
    for r in range(warmup + repeats):
        for t, block in enumerate(blocks):
            t0 = time.perf_counter()
            chain(block)
            if r >= warmup:
                times[t].append(time.perf_counter() - t0)
    costs = [statistics.median(ts) for ts in times]
    for t in range(1, widths):
        costs[t] = max(costs[t], costs[t - 1])
    return costs
