"""Draft-length rules for a batch (BASS, Qian et al. 2024; DESIGN §6): each step, how many of each
row's proposed nodes one target forward verifies.

Terms. A *step* scores every row's block in one forward: decoding rows carry their root plus the
nodes kept from their drafter's tree, prompt rows a chunk of their prompt. A rule acts twice a step:
`limit()` before the drafters propose (the most nodes any row's tree may have: draft work beyond it
would be cut anyway), and `choose(trees, rows, tokens)` after, the number of nodes of each tree to
keep (always a prefix in tree order, so the kept nodes are still a tree: parents precede children).
`observe(trees, accepted)` then reports the kept trees and how many nodes of each the target accepted.

Rules:
- `AsProposed`: every row verifies what its drafter proposed (the drafter's own size or length rule).
- `FixedLength(k)`: at most k nodes a row.
- `BassLength`: BASS's shared length l (drafting/draft_length.py, DynamicDraftLength.update over the
  rows' accepted counts): l0 = 7, +2 (up to 32) when some row accepted all it was given, else shrink.
- `CostAwareBatchLength`: from the measured cost of a forward of B rows x N tokens, the nodes (over all
  rows) that maximise expected emitted tokens per second (draft_length.best_prefixes). A node's gain is
  its drafter's `confidence` (calibrated online by accepted over predicted), or, for nodes without
  one, the product of per-depth acceptance rates learned online. At large B a draft token costs about
  what a row costs, so only near-certain tokens pay and the rule turns speculation off by itself.

Lossless: a rule may size a tree by its nodes' values only where the drafter says so (`confidence`
set: deterministic proposals, or a greedy target). A tree whose nodes carry a draft q (verified by
recursive rejection sampling) is cut only by what the rule knew before it was drawn: a chain by its
learned per-depth rates, a branching tree not at all.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specstack.drafting.draft_length import DynamicDraftLength, best_prefixes
from specstack.tree import DraftTree

# seconds of one target forward over `rows` rows carrying `tokens` tokens in all (engine/batch_cost.py)
ForwardCost = Callable[[int, int], float]


class BatchLength(Protocol):
    def limit(self) -> int | None:
        """Before proposing: the most nodes a row's tree may have this step (None: no limit)."""

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        """Nodes of each tree to verify (a prefix of it). rows: rows in the forward; tokens: the tokens
        it carries besides the trees (every row's root or prompt chunk)."""

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        """The trees as verified (after choose) and how many nodes of each the target accepted."""


def is_chain(tree: DraftTree) -> bool:
    return all(p == i - 1 for i, p in enumerate(tree.parent))


@dataclass
class AsProposed:
    def limit(self) -> int | None:
        return None

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        return [len(t) for t in trees]

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        pass


@dataclass
class FixedLength:
    k: int

    def limit(self) -> int | None:
        return self.k

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        return [min(self.k, len(t)) for t in trees]

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        pass


@dataclass
class BassLength:
    """BASS's dynamic draft length, one l shared by the batch (DESIGN §6)."""

    start: int = 7
    cap: int = 32
    rule: DynamicDraftLength = field(init=False)

    def __post_init__(self) -> None:
        self.rule = DynamicDraftLength(self.start, self.cap)

    def limit(self) -> int | None:
        return self.rule.value

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        return [min(self.rule.value, len(t)) for t in trees]

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        if trees:  # a step in which no row drafted says nothing about l
            self.rule.update(list(accepted))


@dataclass
class CostAwareBatchLength:
    """Each step's nodes for the most expected tokens per second (module docstring).

    pause: the drafter costs real time (a draft model): after `quiet` steps in which the rule kept no
    node at all, `limit()` is 0 (the drafters do no work) except every `probe`-th step, which proposes
    again to see whether drafts pay once more (a context match, fewer rows)."""

    cost: ForwardCost
    pause: bool = False
    quiet: int = 3
    probe: int = 8
    prior: tuple[float, float] = (1.0, 1.0)  # Beta pseudo-counts of each depth's acceptance
    _depth: dict[int, list[float]] = field(init=False, default_factory=dict)  # depth -> [accepted, tried]
    _accepted: float = field(init=False, default=1.0)  # calibration of confidences: accepted / predicted
    _predicted: float = field(init=False, default=1.0)
    _idle: int = field(init=False, default=0)  # consecutive steps that kept no node

    def rate(self, depth: int) -> float:
        """Learned chance that a node at `depth` is accepted once its parent is."""
        a, n = self._depth.get(depth, (0.0, 0.0))
        return (a + self.prior[0]) / (n + self.prior[0] + self.prior[1])

    def limit(self) -> int | None:
        if self.pause and self._idle >= self.quiet and (self._idle - self.quiet) % self.probe:
            return 0
        return None

    def gains(self, tree: DraftTree) -> list[float] | None:
        """Each node's expected acceptance; None for a tree that must be verified whole."""
        if any(q is not None for q in tree.q) and not is_chain(tree):
            return None  # RRS over sampled siblings: never cut by what was drawn
        if all(c is not None for c in tree.confidence) and not any(q is not None for q in tree.q):
            c = self._accepted / self._predicted
            return [min(1.0, c * float(s)) for s in tree.confidence]  # type: ignore[arg-type]
        along: list[float] = []  # per-depth rates, multiplied down each path
        for p, d in zip(tree.parent, tree.depth, strict=True):
            along.append((1.0 if p < 0 else along[p]) * self.rate(d))
        return along

    def choose(self, trees: Sequence[DraftTree], rows: int, tokens: int) -> list[int]:
        gains = [self.gains(t) for t in trees]
        fixed = tokens + sum(len(t) for t, g in zip(trees, gains, strict=True) if g is None)
        keep = best_prefixes([g or [] for g in gains], lambda extra: self.cost(rows, fixed + extra),
                             emitted=float(len(trees)))
        keep = [len(t) if g is None else k for t, g, k in zip(trees, gains, keep, strict=True)]
        self._idle = self._idle + 1 if trees and not any(keep) else 0
        return keep

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[int]) -> None:
        for tree, a in zip(trees, accepted, strict=True):
            if not len(tree):
                continue
            if all(c is not None for c in tree.confidence):
                self._predicted += sum(float(c) for c in tree.confidence)  # type: ignore[arg-type]
                self._accepted += a
            # depths 1..a were accepted; depth a + 1, where the tree goes that deep, was tried and failed
            for d in range(1, min(a + 1, max(tree.depth)) + 1):
                counts = self._depth.setdefault(d, [0.0, 0.0])
                counts[0] += d <= a
                counts[1] += 1

