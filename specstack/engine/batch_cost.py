"""What a batched target forward costs as a function of its rows and its tokens (for a cost-aware
draft length in a batch).

One forward of the batched engine (engine/batched.py) covers `rows` rows; each row carries its root
(one token) plus its draft's nodes, so the forward carries `tokens` >= `rows` tokens in all, and
`extras` = tokens - rows of them are draft nodes. In the SPLIT layout the tokens are packed [1, N]:
the linears see exactly N tokens and attention runs per run of equal rows, rows of 1..4 tokens padded
into one run (attention.row_blocks_batch),
so the cost depends on how many rows and how many tokens, and (a little) on how the extras are spread;
here they are spread as evenly as possible, as chains off each row's root.

The measured grid: row counts at powers of two (1, 2, 4, ...); for each, a curve over extras at every
integer 0..8 then geometric (12, 16, 24, 32, 48, 64, ...) up to `extra_cap(rows)`. `BatchCosts.cost`
interpolates linearly in extras within a curve (past its end: the last slope, never below the last
value), then linearly in rows between the two grid row counts around `rows`. Each curve is made
non-decreasing (a wider forward never costs less; the median of a few noisy samples sometimes says
so), and the larger row count's value never falls below the smaller's.

Measuring is lazy: a grid row count is measured when `cost` first needs it (a batch of 8 never
measures 64 rows) and kept on disk (SPECSTACK_CACHE/batch_costs.json, keyed as width_costs.json is
plus the context per row), so the next process starts at once; delete the file to measure again.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from specstack.engine.timing import RowForwards, ragged_tokens, random_context
from specstack.engine.width_cost import machine_key, read_store, write_store
from specstack.models.base import LoadedModel
from specstack.models.loading import cache_root
from specstack.validate import MAX_TREE

STORE_NAME = "batch_costs.json"
# part of every curve's key: a change to how curves are measured retires the curves measured before it
MEASURE_VERSION = 2  # 2: a leaner grid (0..4, then 1.5x and 2x steps), 2 repeats
DEFAULT_CONTEXT = 256  # committed tokens per row while timing
INTEGER_EXTRAS = 4  # extras 0..4 are all measured: where a batch's draft length usually falls (int4 kernels
# work in blocks of four rows, so the curve's steps are there)
# extras beyond the integers: a row count's curve reaches EXTRA_PER_ROW extras a row (at least MIN_CAP);
# past it the forward is compute-bound and the last slope carries on. Few points: measuring a row count
# must stay short (it runs once per machine, at the first batch of that size)
EXTRA_PER_ROW = 2
MIN_CAP = 16


def extra_cap(rows: int) -> int:
    """The most extras a row count's curve measures."""
    return min(MAX_TREE * rows, max(MIN_CAP, EXTRA_PER_ROW * rows))


def extra_grid(rows: int) -> list[int]:
    """The extras measured at `rows` rows: 0..4, then 6, 8, 12, 16, 24, 32, ... up to extra_cap(rows)."""
    cap = extra_cap(rows)
    grid = list(range(min(INTEGER_EXTRAS, cap) + 1))
    step = INTEGER_EXTRAS
    while step * 2 <= cap:  # 1.5x then 2x of each power of two: 12, 16, 24, 32, ...
        grid += [e for e in (step * 3 // 2, step * 2) if e <= cap]
        step *= 2
    if grid[-1] < cap:
        grid.append(cap)
    return grid


def grid_rows(rows: int) -> tuple[int, int]:
    """The grid row counts around `rows`: the power of two at or below it and the one at or above it."""
    lo = 1 << (rows.bit_length() - 1)
    return lo, lo if lo == rows else lo * 2


@dataclass(frozen=True)
class RowCurve:
    """Seconds of a forward at one row count, per extra tokens: seconds[i] at extras[i] (extras
    increasing, seconds positive and non-decreasing)."""

    extras: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.extras or len(self.extras) != len(self.seconds):
            raise ValueError(f"a curve needs as many seconds as extras (at least one), got {self.extras}, {self.seconds}")
        if self.extras[0] < 0 or any(b <= a for a, b in pairwise(self.extras)):
            raise ValueError(f"a curve's extras must be increasing from >= 0, got {list(self.extras)}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"a curve's seconds must be positive, got {list(self.seconds)}")

    @staticmethod
    def monotone(extras: Sequence[int], seconds: Sequence[float]) -> RowCurve:
        """The curve with each value raised to its predecessor's (a wider forward never costs less)."""
        out = list(seconds)
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1])
        return RowCurve(tuple(extras), tuple(out))

    def at(self, extra: float) -> float:
        """Seconds at `extra` extras: linear between grid points, the last slope past the end (never
        below the last value), the first value before the start."""
        xs, ys = self.extras, self.seconds
        if extra <= xs[0]:
            return ys[0]
        if extra >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + max(0.0, slope) * (extra - xs[-1])
        i = bisect.bisect_right(xs, extra)  # xs[i - 1] <= extra < xs[i]
        f = (extra - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + f * (ys[i] - ys[i - 1])

    def to_json(self) -> dict[str, list[int] | list[float]]:
        return {"extras": list(self.extras), "seconds": list(self.seconds)}

    @staticmethod
    def from_json(data: object) -> RowCurve | None:
        """The curve stored as `data`, or None when it is not a well-formed curve (measure again)."""
        if not isinstance(data, dict):
            return None
        extras, seconds = data.get("extras"), data.get("seconds")
        if not (isinstance(extras, list) and isinstance(seconds, list)
                and all(type(e) is int for e in extras) and all(type(s) is float for s in seconds)):
            return None
        try:
            strict = RowCurve(tuple(extras), tuple(seconds))  # as stored: a negative time is damage, not noise
            return RowCurve.monotone(strict.extras, strict.seconds)
        except ValueError:
            return None


@dataclass
class BatchCosts:
    """cost(rows, tokens): seconds of one target forward over `rows` rows carrying `tokens` tokens in all
    (tokens >= rows: one root per row plus draft nodes), SPLIT layout, at a fixed context per row.

    `curves` holds the known curves by row count; `measure` (None: the curves are all there is)
    supplies the curve of a grid row count the first time `cost` needs it, and the curve is kept."""

    curves: dict[int, RowCurve] = field(default_factory=dict)
    measure: Callable[[int], RowCurve] | None = None

    def cost(self, rows: int, tokens: int) -> float:
        if rows < 1 or tokens < rows:
            raise ValueError(f"a forward needs rows >= 1 and tokens >= rows, got {rows} rows, {tokens} tokens")
        extra = tokens - rows
        lo, hi = self._around(rows)
        low = self.curves[lo].at(extra)
        if lo == hi:
            return low
        high = max(low, self.curves[hi].at(extra))  # more rows never cost less
        return low + (rows - lo) / (hi - lo) * (high - low)

    def _around(self, rows: int) -> tuple[int, int]:
        """The known row counts to interpolate between (equal when `rows` is known)."""
        if self.measure is not None:
            for r in grid_rows(rows):
                if r not in self.curves:
                    self.curves[r] = self.measure(r)
        if rows in self.curves:
            return rows, rows
        known = sorted(self.curves)
        i = bisect.bisect_left(known, rows)
        if i == 0 or i == len(known):
            raise ValueError(f"no curve at or around {rows} rows (curves at rows {known}) and nothing to measure")
        return known[i - 1], known[i]


def batch_costs(lm: LoadedModel, context: int = DEFAULT_CONTEXT, repeats: int = 2) -> BatchCosts:
    """`lm`'s batched forward costs: the curves in the store now, and any other grid row count measured
    (and stored) when first needed."""
    path = cache_root() / STORE_NAME
    key = machine_key(lm, "batch", MEASURE_VERSION, context)

    def stored() -> dict[str, object]:
        entry = read_store(path).get(key)
        return entry if isinstance(entry, dict) else {}

    def measure(rows: int) -> RowCurve:
        # a row's chain and one token of context must fit the model's positions (a tiny test model has 64)
        grid = [e for e in extra_grid(rows) if max(spread(rows, e)) < lm.config.max_seq_len]
        curve = RowCurve.monotone(grid, measure_batch_costs(lm, rows, grid, context=context, repeats=repeats))
        store = read_store(path)  # another process may have written meanwhile
        entry = store.get(key)
        entry = entry if isinstance(entry, dict) else {}
        entry[str(rows)] = curve.to_json()
        store[key] = entry
        write_store(path, store)
        return curve

    curves = {}
    for name, data in stored().items():
        curve = RowCurve.from_json(data)
        if name.isdigit() and int(name) >= 1 and curve is not None:  # a damaged curve is measured again
            curves[int(name)] = curve
    return BatchCosts(curves, measure)


def spread(rows: int, extra: int) -> list[int]:
    """Tokens per row when `extra` extras are spread as evenly as possible over `rows` rows (the first
    rows take one more)."""
    return [1 + extra // rows + (1 if i < extra % rows else 0) for i in range(rows)]


def measure_batch_costs(lm: LoadedModel, rows: int, extras: Sequence[int], context: int = DEFAULT_CONTEXT,
                        repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds (median of `repeats`) of a SPLIT forward over `rows` rows carrying rows + extras[i] tokens,
    each row at `context` committed tokens (fewer when the model's context is shorter), the extras
    spread evenly as chains off each row's root; the forwards commit nothing, so the context stays.
    Non-decreasing in extras."""
    if rows < 1 or not extras or min(extras) < 0 or repeats < 1 or warmup < 0 or context < 1:
        raise ValueError(f"need rows >= 1, extras >= 0 (at least one), repeats >= 1, warmup >= 0 and context >= 1, "
                         f"got {rows}, {list(extras)}, {repeats}, {warmup}, {context}")
    cfg = lm.config
    widest = max(spread(rows, max(extras)))
    ctx = random_context(max(1, min(context, cfg.max_seq_len - widest)), cfg.vocab_size)
    fwd = RowForwards(lm, ctx, rows, widest)
    gen = torch.Generator().manual_seed(0)
    dev = lm.model.device
    steps = [fwd.ragged(spread(rows, e), "split") for e in extras]
    tokens = [ragged_tokens(spread(rows, e), "split", cfg.vocab_size, gen).to(dev) for e in extras]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in extras]
    for r in range(warmup + repeats):
        # a new order every round, as width_cost does: drift and a forward's after-effects (a wide
        # forward slows the next) hit every width alike instead of always the same one
        for i in torch.randperm(len(extras), generator=gen).tolist():
            sync()
            t0 = time.perf_counter()
            steps[i](tokens[i])
            sync()
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
    costs = [statistics.median(ts) for ts in times]
    by_extra = sorted(range(len(extras)), key=lambda i: extras[i])
    for a, b in pairwise(by_extra):  # more tokens never cost less (noise in a median says so at times)
        costs[b] = max(costs[b], costs[a])
    return costs
