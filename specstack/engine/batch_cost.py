"""What a target forward costs as a function of its rows and its tokens: one store, one harness.

One forward of the batched engine (engine/batched.py) covers `rows` rows; each row carries its root
(one token) plus its draft's nodes, so the forward carries `tokens` >= `rows` tokens in all, and
`extras` = tokens - rows of them are draft nodes. In the SPLIT layout the tokens are packed [1, N]:
the linears see exactly N tokens and attention runs per run of equal rows, rows of 1..4 tokens padded
into one run (attention.row_blocks_batch),
so the cost depends on how many rows and how many tokens, and (a little) on how the extras are spread;
here they are spread as evenly as possible, as chains off each row's root, and every token's logits
are computed, as a verify step needs them.

One row is the verification width curve a cost-aware one-row rule reads (drafting/draft_length.py):
`width_costs(lm, n)` is cost(1, T) for T = 1 .. n. On an int4 CPU target that curve is a step function
(the int4 kernel works in blocks of four rows), on a bf16 one nearly flat, so it is measured, not
assumed, and measured at every integer T a method asks for: interpolation would blur the steps the
cost-aware rule chooses between.

The measured grid: row counts at powers of two (1, 2, 4, ...); for each, a curve over extras at every
integer 0..4 (0..n - 1 for the one-row curve once a width curve of n was asked for) then geometric
(6, 8, 12, 16, 24, 32, 48, 64, ...) up to `extra_cap(rows)`. `BatchCosts.cost` interpolates linearly in
extras within a curve (past its end: the last slope, never below the last value), then linearly in rows
between the two grid row counts around `rows`. Each curve is made non-decreasing (a wider forward never
costs less; the median of a few noisy samples sometimes says so), and the larger row count's value
never falls below the smaller's.

One harness measures every curve (`measure_batch_costs`): timed SPLIT forwards (timing.RowForwards)
that write scratch only, so every repeat runs at the same context, interleaved across extras in a new
random order each round (drift and the previous forward's after-effects hit all widths alike), median
per point.

Measuring is lazy: a grid row count is measured when `cost` first needs it (a batch of 8 never measures
64 rows), the one-row curve again when a wider width curve is asked for than it holds, and every curve
is kept on disk (SPECSTACK_CACHE/batch_costs.json) under `machine_key`: what a forward's time depends
on (the CPU's family and the kernels' sources among it), plus the measurement's version and the context
per row. The next process starts at once; delete
the file to measure again (after a change of machine load, say).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

from specstack.engine.timing import RowForwards, ragged_tokens, random_context
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text
from specstack.machine import cpu_model
from specstack.models import native
from specstack.models.base import LoadedModel
from specstack.models.loading import cache_root
from specstack.models.quant import weights_label
from specstack.validate import MAX_TREE

STORE_NAME = "batch_costs.json"
# part of every curve's key: a change to how curves are measured retires the curves measured before it
# (3: one store and one harness for the width curve and the batch curves, every token's logits timed)
MEASURE_VERSION = 3
DEFAULT_CONTEXT = 256  # committed tokens per row while timing
INTEGER_EXTRAS = 4  # extras 0..4 are all measured: where a batch's draft length usually falls (int4 kernels
# work in blocks of four rows, so the curve's steps are there)
# extras beyond the integers: a row count's curve reaches EXTRA_PER_ROW extras a row (at least MIN_CAP);
# past it the forward is compute-bound and the last slope carries on. Few points: measuring a row count
# must stay short (it runs once per machine, at the first batch of that size)
EXTRA_PER_ROW = 2
MIN_CAP = 16
# repeats per point: a one-row forward is the cheapest and its curve is read point by point (the width
# curve), so it gets more; larger row counts keep their measurement short
ONE_ROW_REPEATS = 5
ROW_REPEATS = 2


def extra_cap(rows: int) -> int:
    """The most extras a row count's curve measures (unless asked for more integers)."""
    return min(MAX_TREE * rows, max(MIN_CAP, EXTRA_PER_ROW * rows))


def extra_grid(rows: int, dense: int = INTEGER_EXTRAS) -> list[int]:
    """The extras measured at `rows` rows: every integer 0..dense, then the geometric points above it
    (6, 8, 12, 16, 24, 32, ...: 1.5x and 2x of each power of two) up to extra_cap(rows)."""
    cap = max(extra_cap(rows), dense)
    grid = list(range(dense + 1))
    step = INTEGER_EXTRAS
    while step * 2 <= cap:
        grid += [e for e in (step * 3 // 2, step * 2) if dense < e <= cap]
        step *= 2
    if grid[-1] < cap:
        grid.append(cap)
    return grid


def grid_rows(rows: int) -> tuple[int, int]:
    """The grid row counts around `rows`: the power of two at or below it and the one at or above it."""
    lo = 1 << (rows.bit_length() - 1)
    return lo, lo if lo == rows else lo * 2


def default_repeats(rows: int) -> int:
    return ONE_ROW_REPEATS if rows == 1 else ROW_REPEATS


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
        """The curve with each value raised to its predecessor's (a wider forward never costs less).
        The one such pass: every measured or stored curve goes through it."""
        out = list(seconds)
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1])
        return RowCurve(tuple(extras), tuple(out))

    def dense_to(self, extra: int) -> bool:
        """Whether every integer extras 0..extra was measured (increasing integers from >= 0: the
        first extra + 1 are exactly 0..extra)."""
        return len(self.extras) > extra and self.extras[extra] == extra

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


# (rows, dense) -> the curve at a grid row count, every integer extras 0..dense measured
Measure = Callable[[int, int], RowCurve]


@dataclass
class BatchCosts:
    """cost(rows, tokens): seconds of one target forward over `rows` rows carrying `tokens` tokens in all
    (tokens >= rows: one root per row plus draft nodes), SPLIT layout, at a fixed context per row;
    widths(n): the one-row curve over T = 1 .. n tokens, every T measured.

    `curves` holds the known curves by row count; `measure` (None: the curves are all there is)
    supplies the curve of a grid row count the first time it is needed, and the curve is kept."""

    curves: dict[int, RowCurve] = field(default_factory=dict)
    measure: Measure | None = None

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

    def widths(self, widths: int) -> list[float]:
        """Seconds of a one-row forward over T = 1 .. `widths` tokens, from a one-row curve measured at
        every such T (a curve dense that far serves; a narrower one is measured again, wider)."""
        if widths < 1:
            raise ValueError(f"need widths >= 1, got {widths}")
        one = self.curves.get(1)
        if one is None or not one.dense_to(widths - 1):
            if self.measure is None:
                raise ValueError(f"no one-row curve measured at every width up to {widths} and nothing to measure")
            self.curves[1] = self.measure(1, max(INTEGER_EXTRAS, widths - 1))
        return [self.cost(1, t) for t in range(1, widths + 1)]

    def _around(self, rows: int) -> tuple[int, int]:
        """The known row counts to interpolate between (equal when `rows` is known)."""
        if self.measure is not None:
            for r in grid_rows(rows):
                if r not in self.curves:
                    self.curves[r] = self.measure(r, INTEGER_EXTRAS)
        if rows in self.curves:
            return rows, rows
        known = sorted(self.curves)
        i = bisect.bisect_left(known, rows)
        if i == 0 or i == len(known):
            raise ValueError(f"no curve at or around {rows} rows (curves at rows {known}) and nothing to measure")
        return known[i - 1], known[i]


def width_costs(lm: LoadedModel, widths: int) -> list[float]:
    """Seconds of a one-row forward of `lm` over T = 1 .. `widths` tokens (the curve a cost-aware
    one-row rule takes, drafting/draft_length.py): cost(1, T) of the one store, each T measured."""
    return batch_costs(lm).widths(widths)


def batch_costs(lm: LoadedModel, context: int = DEFAULT_CONTEXT, repeats: int | None = None) -> BatchCosts:
    """`lm`'s forward costs: the curves in the store now, and any other grid row count (or a wider
    one-row curve) measured and stored when first needed. repeats: per point (None: default_repeats)."""
    path = cache_root() / STORE_NAME
    key = machine_key(lm, "batch", MEASURE_VERSION, context)

    def stored() -> dict[str, object]:
        entry = read_store(path).get(key)
        return entry if isinstance(entry, dict) else {}

    def measure(rows: int, dense: int) -> RowCurve:
        # a row's chain and one token of context must fit the model's positions (a tiny test model has 64)
        fits = [e for e in extra_grid(rows, dense) if max(spread(rows, e)) < lm.config.max_seq_len]
        if fits[-1] < dense:
            raise SpecstackError(f"a forward of {dense + 1} tokens after one token of context does not fit "
                                 f"the model's context of {lm.config.max_seq_len} tokens")
        curve = measure_batch_costs(lm, rows, fits, context=context,
                                    repeats=default_repeats(rows) if repeats is None else repeats)
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


def machine_key(lm: LoadedModel, *more: object) -> str:
    """A store key for a measured cost of `lm`'s forwards: the model's shape and weight format with the
    kernel path that runs it and the kernels' sources, the device, the thread count, the torch version,
    the CPU with its family (not the weights' values: a forward's time does not depend on them), then
    `more` (JSON values: the measurement's version and settings)."""
    what = [repr(lm.config), weights_label(lm.fmt, lm.model.device), native.sources_digest(), lm.model.device.type,
            torch.get_num_threads(), torch.__version__, cpu_model(), *more]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def read_store(path: Path) -> dict[str, object]:
    """The store's entries; {} when the file is missing or damaged."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # missing or damaged: measure again (and rewrite it whole)
    return data if isinstance(data, dict) else {}


def write_store(path: Path, store: dict[str, object]) -> None:
    """Rewrite the store whole, atomically; a store that cannot be written is left as it is."""
    try:
        atomic_write_text(path, json.dumps(store, indent=1) + "\n", parents=True)  # a reader never sees half
    except OSError:
        pass  # a read-only cache only costs the next start a measurement


def spread(rows: int, extra: int) -> list[int]:
    """Tokens per row when `extra` extras are spread as evenly as possible over `rows` rows (the first
    rows take one more)."""
    return [1 + extra // rows + (1 if i < extra % rows else 0) for i in range(rows)]


def measure_batch_costs(lm: LoadedModel, rows: int, extras: Sequence[int], context: int = DEFAULT_CONTEXT,
                        repeats: int = 3, warmup: int = 1) -> RowCurve:
    """The curve of a SPLIT forward over `rows` rows carrying rows + e tokens for each e in `extras`
    (median of `repeats` seconds, made non-decreasing), each row at `context` committed tokens (fewer
    when the model's context is shorter), the extras spread evenly as chains off each row's root, every
    token's logits computed; the forwards commit nothing, so the context stays."""
    if rows < 1 or not extras or min(extras) < 0 or repeats < 1 or warmup < 0 or context < 1:
        raise ValueError(f"need rows >= 1, extras >= 0 (at least one), repeats >= 1, warmup >= 0 and context >= 1, "
                         f"got {rows}, {list(extras)}, {repeats}, {warmup}, {context}")
    extras = sorted(set(extras))
    cfg = lm.config
    widest = max(spread(rows, extras[-1]))
    ctx = random_context(max(1, min(context, cfg.max_seq_len - widest)), cfg.vocab_size)
    fwd = RowForwards(lm, ctx, rows, widest)
    gen = torch.Generator().manual_seed(0)
    dev = lm.model.device
    steps = [fwd.ragged(spread(rows, e), "split", logits="all") for e in extras]
    tokens = [ragged_tokens(spread(rows, e), "split", cfg.vocab_size, gen).to(dev) for e in extras]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in extras]
    for r in range(warmup + repeats):
        # a new order every round: a forward right after the widest one runs slower on the CPU, which
        # in a fixed order always hit the same width (T = 1 looked dear and T = 2..4 free)
        for i in torch.randperm(len(extras), generator=gen).tolist():
            sync()
            t0 = time.perf_counter()
            steps[i](tokens[i])
            sync()
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
    return RowCurve.monotone(extras, [statistics.median(ts) for ts in times])
