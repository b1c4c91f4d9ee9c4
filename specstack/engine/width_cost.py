"""What a target forward costs as a function of how many tokens it scores (the verification width).

A cost-aware draft length (drafting/draft_length.py) needs this curve, and it is a property of the
machine, the weight format and the thread count, not something to assume: on an int4 CPU target it
is a step function (blocks of four rows in the int4 kernel), on a bf16 one nearly flat. So it is
measured (`measure_width_costs`): chain forwards of T = 1 .. n tokens over a committed context,
interleaved across widths in a new random order each round (drift and the previous forward's
after-effects hit all widths alike), median per width, made non-decreasing (a
wider forward never costs less; the median of a few noisy samples sometimes says so).

`width_costs` keeps each measured curve on disk (SPECSTACK_CACHE/width_costs.json), keyed by what the
curve depends on: the model's shape and weight format, the device, the thread count, the torch
version and the CPU. A cost-sized method then starts at once instead of measuring for seconds at
every start; delete the file to measure again (after a change of machine load, say).
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from specstack.engine.timing import forward_steps, random_context
from specstack.files import atomic_write_text
from specstack.machine import cpu_model
from specstack.models.base import LoadedModel
from specstack.models.loading import cache_root

STORE_NAME = "width_costs.json"
# part of every curve's key: a change to how curves are measured retires the curves measured before it
# (2: widths in a new random order each round)
MEASURE_VERSION = 2


def width_costs(lm: LoadedModel, widths: int, repeats: int = 5) -> list[float]:
    """The forward costs of widths 1 .. `widths` (seconds), from the store or measured and stored.
    A stored curve at least as wide serves any narrower request (its prefix)."""
    if widths < 1:
        raise ValueError(f"need widths >= 1, got {widths}")
    path = cache_root() / STORE_NAME
    key = curve_key(lm)
    store = read_store(path)
    known = store.get(key)
    if isinstance(known, list) and len(known) >= widths and all(isinstance(c, float) and c > 0 for c in known):
        return known[:widths]
    costs = measure_width_costs(lm, widths, repeats=repeats)
    store = read_store(path)  # another process may have written meanwhile
    store[key] = costs
    write_store(path, store)
    return costs


def curve_key(lm: LoadedModel) -> str:
    """What a width-cost curve depends on (not the weights' values: a forward's time does not)."""
    return machine_key(lm, MEASURE_VERSION)


def machine_key(lm: LoadedModel, *more: object) -> str:
    """A store key for a measured cost of `lm`'s forwards: the model's shape and weight format, the
    device, the thread count, the torch version, the CPU, then `more` (JSON values: the measurement's
    version and settings). Shared by every cost store (width_costs.json, batch_costs.json)."""
    what = [repr(lm.config), lm.fmt, lm.model.device.type, torch.get_num_threads(), torch.__version__, cpu_model(),
            *more]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def read_store(path: Path) -> dict[str, object]:
    """A cost store's entries; {} when the file is missing or damaged."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # missing or damaged: measure again (and rewrite it whole)
    return data if isinstance(data, dict) else {}


def write_store(path: Path, store: dict[str, object]) -> None:
    """Rewrite a cost store whole, atomically; a store that cannot be written is left as it is."""
    try:
        atomic_write_text(path, json.dumps(store, indent=1) + "\n", parents=True)  # a reader never sees half
    except OSError:
        pass  # a read-only cache only costs the next start a measurement


def measure_width_costs(lm: LoadedModel, widths: int, context: int = 256, repeats: int = 5,
                        warmup: int = 1) -> list[float]:
    """Seconds of a target forward over T = 1 .. `widths` tokens after `context` committed ones."""
    if widths < 1 or repeats < 1:
        raise ValueError(f"need widths >= 1 and repeats >= 1, got {widths}, {repeats}")
    cfg = lm.config
    ctx = random_context(max(1, min(context, cfg.max_seq_len - widths)), cfg.vocab_size)
    chain = forward_steps(lm, ctx, widths)[f"specstack {lm.fmt} chain"]
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, cfg.vocab_size, (1, t), generator=gen).to(lm.model.device) for t in range(1, widths + 1)]
    times: list[list[float]] = [[] for _ in blocks]
    for r in range(warmup + repeats):
        # a new order every round: a forward right after the widest one (through the dense copies)
        # ran up to 25 % slower, which in a fixed order always hit T = 1 and made T = 2..4 look free
        for t in torch.randperm(len(blocks), generator=gen).tolist():
            t0 = time.perf_counter()
            chain(blocks[t])
            if r >= warmup:
                times[t].append(time.perf_counter() - t0)
    costs = [statistics.median(ts) for ts in times]
    for t in range(1, widths):
        costs[t] = max(costs[t], costs[t - 1])
    return costs
