"""Draft-length rules (BASS, Qian et al. 2024; DESIGN §6): each step, how many of each row's proposed
nodes one target forward verifies. One rule serves one row and many: one sequence is a batch of one,
and a forward of one row over T tokens costs cost(1, T).

Terms. A *step* scores every row's block in one forward: decoding rows carry their root plus the
nodes kept from their drafter's tree, prompt rows a chunk of their prompt. A rule acts before the
drafters propose, `limit(shape)`: the most nodes any row's tree may have (draft work beyond it would be
cut anyway; `StepShape`: the rows and tokens the plan gives the step), and after,
`choose(trees, rows, tokens)`: the number of nodes of each tree to keep (always a prefix in tree order,
so the kept nodes are still a tree: parents precede children).
`observe(trees, accepted)` then reports the kept trees and how many nodes of each the target accepted.
Drafters own no rule: they propose up to ctx.limit and say what they know of each node
(DraftTree.confidence, .evidence) and, in ctx.lessons, what they learned since of nodes cut unverified. A rule's `size` (None for most), handed to the drafters
as ctx.size, lets a best-first drafter stop growing nodes the rule would cut (drafting/model.py).

Rules:
- `AsProposed`: every row verifies what its drafter proposed.
- `FixedLength(k)`: at most k nodes a row.
- `BassLength`: BASS's length l, shared by the batch: start at l = start; after each step, if some
  row accepted all it was given, l = min(l + 2, cap) and s = 0; else shrink towards what was accepted,
  l = max(1, max_i accepted_i, l - ceil(l / 10) - s), s = 1 (a second miss in a row shrinks one more).
  A fixed length wastes tokens where drafts are wrong and stops too early where they are right (n-gram
  drafts are bimodal: on code a context match is usually right for many tokens in a row).
- `CostAwareLength`: from the measured cost of a forward of B rows x N tokens, the nodes (over all
  rows) that maximise expected emitted tokens per second (draft_length.best_prefixes); the time the
  step has spent drafting counts in its cost. A node's gain is its drafter's `confidence` (its
  cumulative draft probability, calibrated online by accepted over predicted), else the product of
  learned acceptance rates (draft_length.AcceptanceRates) down its path: per evidence class on a
  chain whose nodes carry evidence, per depth otherwise. A forward's cost is a step function of its
  tokens on an int4 CPU target (the kernel works in blocks of rows), so the best length depends on how
  sure each node is, which BASS's rule, counting only acceptances, does not see. At large B a draft
  token costs about what a row costs, so only near-certain tokens pay and the rule turns speculation
  off by itself.

Lossless: a rule may size a tree by its nodes' values only where the drafter says so (`confidence`
set: deterministic proposals, or a greedy target; `evidence` on nodes without q). A tree whose nodes
carry a draft q (verified by recursive rejection sampling) is cut only by what the rule knew before it
was drawn: a chain by its learned per-depth rates, a branching tree not at all.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specstack.drafting.draft_length import AcceptanceRates, Evidence, best_prefixes
from specstack.tree import DraftTree

BACKOFF = 8  # a paused rule's probes are at most this many times `probe` steps apart

# seconds of one target forward over `rows` rows carrying `tokens` tokens in all (engine/batch_cost.py)
ForwardCost = Callable[[int, int], float]
# scores of a growing best-first tree's nodes, best first -> how many of them the rule would keep
Sizer = Callable[[Sequence[float]], int]


@dataclass(frozen=True)
class StepShape:
    """A step's forward besides its draft nodes: `rows` rows carrying `tokens` tokens in all (every
    row's root or prompt chunk), `trees` of the rows drafting (at least 1)."""

    rows: int
    tokens: int
    trees: int = 1


class BatchLength(Protocol):
    @property
    def size(self) -> Sizer | None:
        """While a best-first tree grows, how many of its nodes the rule would keep (None: no estimate)."""

    def limit(self, shape: StepShape | None = None) -> int | None:
        """Before proposing: the most nodes a row's tree may have this step (None: no limit). shape: the
        step's, as far as the plan knows it before drafting (None: as the last step's)."""

    def trial(self) -> int | None:
        """After limit(): how many of the step's rooted rows may draft (None: every one; the first rows
        in batch order draft)."""

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        """Nodes of each tree to verify (a prefix of it). rows: rows in the forward; tokens: the tokens
        it carries besides the trees (every row's root or prompt chunk)."""

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        """The trees as verified (after choose) and how many nodes of each the target accepted."""

    def learn(self, lessons: Sequence[tuple[Evidence, bool]]) -> None:
        """Before choose: what the drafters learned since of nodes cut unverified ((evidence, right?))."""


def is_chain(tree: DraftTree) -> bool:
    return all(p == i - 1 for i, p in enumerate(tree.parent))


@dataclass
class FixedLength:
    k: int | None = None  # None: as proposed
    size = None

    def limit(self, shape: StepShape | None = None) -> int | None:
        return self.k

    def trial(self) -> int | None:
        return None

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        return [len(t) if self.k is None else min(self.k, len(t)) for t in trees]

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        pass

    def learn(self, lessons: Sequence[tuple[Evidence, bool]]) -> None:
        pass  # a fixed length learns nothing


class AsProposed(FixedLength):
    """Every row verifies what its drafter proposed: FixedLength(None)."""


@dataclass
class BassLength(FixedLength):
    """BASS's dynamic draft length, one l shared by the batch (module docstring)."""

    k: int | None = field(init=False, default=None)  # l, from start on
    start: int = 7
    cap: int = 32
    _shrink: int = field(init=False, default=0)  # s: 1 after a step in which no row accepted all

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.cap:
            raise ValueError(f"draft length: need 1 <= start <= cap, got start {self.start}, cap {self.cap}")
        self.k = self.start

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        if not trees:  # a step in which no row drafted says nothing about l
            return
        l = self.k or 1
        if any(a >= l for a in accepted):
            self.k, self._shrink = min(l + 2, self.cap), 0
        else:
            self.k = max(1, max(accepted), l - math.ceil(l / 10) - self._shrink)
            self._shrink = 1


@dataclass
class CostAwareLength:
    """Each step's nodes for the most expected tokens per second (module docstring).

    longest: the most nodes a row may verify (None: what its drafter proposes).
    pause: from how many rows drafting pauses (0: never; True, i.e. 1: always, for a drafter whose work
    costs real time even for one row, a draft model's chain): while the last step had that many rows,
    after `quiet` steps whose drafts did not pay for their drafting (no node kept, or fewer expected
    tokens a second than the step without drafts), `limit()` is 0 (the drafters do no work)
    except for a probe, which proposes again to see whether drafts pay once more (a context match, fewer
    rows): the first `probe` steps after the pause began, and each probe that finds nothing doubles the
    wait for the next (up to `probe` x BACKOFF), so drafts that never pay cost ever fewer steps. A
    server's rule pauses from 2 rows, so a stream alone keeps looking.
    trial_rows: while drafting has not paid (before any step did, and after each step that did not), only
    this many of a batch's rows draft (0: every row): a draft model's forwards and its reading of each
    row's prompt cost the batch real time, and one row's drafts tell whether drafting pays as well as
    all rows' do; the step after one of decoding rows only that paid, every row drafts."""

    cost: ForwardCost
    longest: int | None = None
    pause: int = 0
    quiet: int = 3
    probe: int = 8
    trial_rows: int = 0
    prior: tuple[float, float] = (1.0, 1.0)  # Beta pseudo-counts of each class's acceptance
    clock: Callable[[], float] = time.perf_counter  # seconds, for the step's drafting time
    rates: AcceptanceRates = field(init=False)
    _accepted: float = field(init=False, default=1.0)  # calibration of confidences: accepted / predicted
    _predicted: float = field(init=False, default=1.0)
    _idle: int = field(init=False, default=0)  # consecutive steps whose drafts did not pay
    _next: int = field(init=False, default=-1)  # while paused: the idle count at which the next probe drafts
    _gap: int = field(init=False, default=0)  # steps from that probe to the one after, if it finds nothing
    _probing: bool = field(init=False, default=False)  # this step is a paused rule's probe
    _open: bool = field(init=False, default=False)  # no trial: every row drafts (trial_rows)
    _began: float | None = field(init=False, default=None)  # when this step's drafting began (limit)
    _last: StepShape = field(init=False, default=StepShape(1, 1))  # the last step's
    _step: StepShape | None = field(init=False, default=None)  # this step's, as limit() was told it

    def __post_init__(self) -> None:
        self.rates = AcceptanceRates(self.prior)
        self._next, self._gap = self.quiet, self.probe

    def limit(self, shape: StepShape | None = None) -> int | None:
        self._began = self.clock()
        self._step = shape
        paused = bool(self.pause) and self._last.rows >= self.pause and self._idle >= self.quiet
        self._probing = paused and self._idle >= self._next
        return 0 if paused and not self._probing else self.longest

    def trial(self) -> int | None:
        return self.trial_rows if self.trial_rows and not self._open else None

    def classes(self, tree: DraftTree) -> list[Evidence]:
        """What each node's acceptance is learned and predicted by: its evidence on a deterministic
        chain, else its depth (known before any draw; a branching tree's verdict names no node)."""
        if is_chain(tree) and all(e is not None for e in tree.evidence) and all(q is None for q in tree.q):
            return list(tree.evidence)
        return list(tree.depth)

    def gains(self, tree: DraftTree) -> list[float] | None:
        """Each node's expected acceptance; None for a tree that must be verified whole."""
        sampled = any(q is not None for q in tree.q)
        if sampled and not is_chain(tree):
            return None  # RRS over sampled siblings: never cut by what was drawn
        if not sampled and all(c is not None for c in tree.confidence):
            return self.calibrated(tree.confidence)  # type: ignore[arg-type]
        along: list[float] = []  # learned rates, multiplied down each path
        for p, cls in zip(tree.parent, self.classes(tree), strict=True):
            along.append((1.0 if p < 0 else along[p]) * self.rates.p(cls))
        return along

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        c = self._accepted / self._predicted
        return [min(1.0, c * float(s)) for s in confidence]

    def step_cost(self, rows: int, tokens: int) -> Callable[[int], float]:
        """The step's seconds with `extra` draft nodes: its drafting so far, then the forward."""
        drafted = 0.0 if self._began is None else self.clock() - self._began
        return lambda extra: drafted + self.cost(rows, tokens + extra)

    def size(self, scores: Sequence[float]) -> int:
        """While a best-first tree grows: how many of its nodes (scores: cumulative draft probabilities,
        best first) pay, were they the only draft of this step (its shape as limit() was told it, else
        the last step's: a step that also reads a prompt chunk makes nodes cheaper than a decode step)."""
        shape = self._step or self._last
        gains = self.calibrated(scores[: self.longest])
        return best_prefixes([gains], self.step_cost(shape.rows, shape.tokens), float(shape.trees))[0]

    def learn(self, lessons: Sequence[tuple[Evidence, bool]]) -> None:
        for cls, right in lessons:
            self.rates.trial(cls, right)

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        gains = [self.gains(t) for t in trees]
        fixed = tokens + sum(len(t) for t, g in zip(trees, gains, strict=True) if g is None)
        keep = best_prefixes([(g or [])[: self.longest] for g in gains], self.step_cost(rows, fixed),
                             emitted=float(len(trees)))
        keep = [len(t) if g is None else k for t, g, k in zip(trees, gains, keep, strict=True)]
        paid = bool(trees) and self._pays(gains, keep, rows, tokens)
        if trees:
            # a trial ends with a paying step of decoding rows only: one that also reads prompt chunks is
            # long anyway, so its drafts look cheaper than they will be in the decoding steps that follow
            self._open = paid and (self._open or tokens <= rows)
        self._idle = 0 if paid or not trees else self._idle + 1
        if not self._idle:
            self._next, self._gap = self.quiet, self.probe
        elif self._probing:  # a probe that found nothing: the next one waits twice as long
            self._next, self._gap = self._idle - 1 + self._gap, min(2 * self._gap, BACKOFF * self.probe)
        self._probing = False
        self._last, self._step = StepShape(rows, tokens, max(1, len(trees))), None
        return keep

    def _pays(self, gains: Sequence[list[float] | None], keep: Sequence[int], rows: int, tokens: int) -> bool:
        """Whether the step's kept nodes pay for all of its drafting: more expected tokens a second than
        the same step with no draft at all (the drafting rows' one token each at cost(rows, tokens)). The
        choice of nodes counts the drafting done so far as spent; this verdict does not, so a draft whose
        forwards cost more than its accepted tokens save (a draft model beside a batched target whose
        rows are nearly free) counts as idle and pauses, though some node of each step still pays."""
        if not any(keep):
            return False
        if any(g is None for g in gains):
            return True  # a tree verified whole: nothing to weigh it by
        emitted = len(keep) + sum(sum(g[:k]) for g, k in zip(gains, keep, strict=True) if g is not None)
        with_drafts = emitted / self.step_cost(rows, tokens)(sum(keep))
        return with_drafts > len(keep) / self.cost(rows, tokens)

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        for tree, a in zip(trees, accepted, strict=True):
            if not len(tree):
                continue
            if all(c is not None for c in tree.confidence):
                self._predicted += sum(float(c) for c in tree.confidence if c is not None)
                self._accepted += a
            # the accepted path's nodes were trials that succeeded; the next one, where the tree goes that
            # deep, failed (a chain's nodes in order; a tree's by depth)
            classes = self.classes(tree)
            path = classes if is_chain(tree) else list(range(1, max(tree.depth) + 1))
            for i, cls in enumerate(path[: a + 1]):
                self.rates.trial(cls, i < a)
