"""Draft-length rules: BASS's dynamic length (Qian et al. 2024; DESIGN §6), for one sequence or a
batch, and a cost-aware choice for one sequence (`CostAwareLength`, below); both serve `ChainLength`.

BASS's rule: start at `l = start`. After each verification, if some row accepted all `l` drafts the
draft was too short: `l = min(l + 2, cap)`, `s = 0`. Otherwise shrink towards what was accepted:
`l = max(1, max_i accepted_i, l - ceil(l / 10) - s)`, `s = 1` (a second miss in a row shrinks one more).

Why it pays for a chain: a verification forward costs more with every token it scores (on an int4
CPU target 10-15 % of a one-token step per extra token up to four, then a jump), and n-gram drafts
are bimodal: on code a context match is usually right for many tokens in a row, elsewhere the first guess is usually wrong.
A fixed length wastes tokens in the second case and stops too early in the first.
"""
from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# What a drafter knows about a proposed token that predicts its acceptance (its origin, the length of
# the match behind it, its depth...); a length rule may learn a rate per class or ignore it.
Evidence = Hashable


class ChainLength(Protocol):
    """A rule for the length of each step's draft chain, for one sequence."""

    def reset(self) -> None:
        """A new sequence starts."""

    def longest(self) -> int:
        """The longest chain this step may verify (the drafter grows that many tokens)."""

    def choose(self, classes: Sequence[Evidence]) -> int:
        """How many tokens of the grown chain (classes[i]: the evidence of its (i+1)-th token) to verify."""

    def observe(self, classes: Sequence[Evidence], accepted: int) -> None:
        """The verified chain's evidence, and how many of its tokens were accepted."""

    def confidence(self, classes: Sequence[Evidence]) -> list[float] | None:
        """Each token's estimated chance that the chain is accepted up to it (None: no estimate)."""


@dataclass
class DynamicDraftLength:
    start: int = 7
    cap: int = 32
    value: int = field(init=False)
    _shrink: int = field(init=False, default=0)  # s: 1 after a step in which no row accepted all

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.cap:
            raise ValueError(f"draft length: need 1 <= start <= cap, got start {self.start}, cap {self.cap}")
        self.reset()

    def reset(self) -> None:
        self.value, self._shrink = self.start, 0

    # ChainLength, for one sequence: the chain is `value` long whatever the evidence
    def longest(self) -> int:
        return self.value

    def choose(self, classes: Sequence[Evidence]) -> int:
        return min(self.value, len(classes))

    def observe(self, classes: Sequence[Evidence], accepted: int) -> None:
        self.update([accepted])

    def confidence(self, classes: Sequence[Evidence]) -> list[float] | None:
        return None  # BASS's rule counts acceptances; it has no estimate per token

    def update(self, accepted: Sequence[int]) -> int:
        """Accepted draft tokens of every row in the step just verified (each proposed `value`
        tokens, or fewer where a row ran out of proposals); returns the next length."""
        l = self.value
        if any(a >= l for a in accepted):
            self.value, self._shrink = min(l + 2, self.cap), 0
        else:
            self.value = max(1, max(accepted, default=0), l - math.ceil(l / 10) - self._shrink)
            self._shrink = 1
        return self.value


def best_prefix(gains: Sequence[float], costs: Sequence[float], fixed: float = 0.0) -> int:
    """argmax over n in 0..len(gains) of (1 + sum_{i<n} gains[i]) / (fixed + costs[n]): how many of a
    step's proposed tokens (best first, gains[i] the expected acceptance the (i+1)-th adds) to verify,
    for expected emitted tokens per second; costs[T - 1] is a target forward over T tokens. Ties keep
    the fewer tokens. One row of `best_prefixes`, the one rule behind CostAwareLength (chains),
    CostAwareBudget (trees) and the batch's CostAwareBatchLength."""
    gains = list(gains[: len(costs) - 1])
    return best_prefixes([gains], lambda extra: fixed + costs[extra], emitted=1.0)[0]


def best_prefixes(gains: Sequence[Sequence[float]], cost: Callable[[int], float], emitted: float) -> list[int]:
    """How many of each row's proposed nodes (a prefix, in the row's order) one forward verifies, for
    the most expected emitted tokens per second: gains[r][i] is the expected acceptance row r's
    (i+1)-th node adds, cost(extra) the forward's seconds with `extra` draft nodes in all, `emitted`
    the tokens the step emits with none (one per decoding row).

    Nodes are taken greedily, the largest gain next among the rows' next nodes, and the best rate seen
    wins (ties keep the fewer nodes). When each row's gains do not increase along its order (a chain's
    survival probabilities; a tree's nodes best first) this is the exact optimum of
    (emitted + sum of kept gains) / cost(kept) for a cost that depends on the total only: the best
    set of any size m is then the m largest gains. One row is `best_prefix`."""
    counts = [0] * len(gains)
    best, expected = list(counts), emitted
    best_rate = expected / cost(0)
    heap = [(-g[0], r) for r, g in enumerate(gains) if g]
    heapq.heapify(heap)
    extra = 0
    while heap:
        neg, r = heapq.heappop(heap)
        counts[r] += 1
        extra += 1
        expected -= neg
        rate = expected / cost(extra)
        if rate > best_rate:
            best, best_rate = list(counts), rate
        if counts[r] < len(gains[r]):
            heapq.heappush(heap, (-gains[r][counts[r]], r))
    return best


@dataclass
class CostAwareLength:
    """Each step's chain length chosen to maximise expected emitted tokens per second of verification.

    Why: on an int4 CPU target the cost of a verification forward over T tokens is a step function of
    T (the int4 kernel works in blocks of rows: T = 1..4 cost 1.0-1.35 x a one-token step, T = 5
    jumps to 1.75 x), so the best length depends on how sure each proposed token is, and BASS's rule,
    which only counts how many were accepted, lands on the expensive widths. Here every proposed token
    carries an evidence class (for n-grams: its origin, the length of the context match behind it,
    its depth); the acceptance rate of each class is learned online (Beta prior, per sequence), and
    for a chain whose i-th token is accepted with probability p_i given the ones before it,

        L* = argmax over L in 0..len(chain) of (1 + sum_{j<=L} prod_{i<=j} p_i) / cost(1 + L),

    the expected tokens a step emits (accepted drafts plus the target's own token) over its cost.
    `costs[T - 1]` is the measured time of a target forward over T tokens (engine/batch_cost.py).
    """

    costs: Sequence[float]
    prior: tuple[float, float] = (1.0, 1.0)  # Beta(accepted, rejected) pseudo-counts of every class
    _counts: dict[Hashable, list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.costs) < 1 or any(not c > 0 for c in self.costs):
            raise ValueError(f"width costs must be positive, got {list(self.costs)}")
        self.costs = tuple(float(c) for c in self.costs)
        if not min(self.prior) > 0:
            raise ValueError(f"the Beta prior's pseudo-counts must be positive, got {self.prior}")

    def reset(self) -> None:
        self._counts = {}

    def longest(self) -> int:
        return len(self.costs) - 1  # the longest chain with a known cost

    def p(self, cls: Hashable) -> float:
        a, r = self._counts.get(cls, (0.0, 0.0))
        return (a + self.prior[0]) / (a + r + self.prior[0] + self.prior[1])

    def choose(self, classes: Sequence[Hashable]) -> int:
        """How many tokens of a proposed chain (classes[i]: the class of its (i+1)-th token) to verify."""
        return best_prefix(self.confidence(classes[: self.longest()]), self.costs)

    def confidence(self, classes: Sequence[Hashable]) -> list[float]:
        """The chance the chain survives to each token: prod_{i<=j} p_i."""
        return list(itertools.accumulate((self.p(cls) for cls in classes), operator.mul))

    def observe(self, classes: Sequence[Hashable], accepted: int) -> None:
        """The verified chain had these classes and its first `accepted` tokens were accepted: every
        token up to the first rejected one was a trial of its class."""
        for i, cls in enumerate(classes[: accepted + 1]):
            c = self._counts.setdefault(cls, [0.0, 0.0])
            c[0 if i < accepted else 1] += 1


@dataclass
class CostAwareBudget:
    """How many nodes of a model drafter's tree to verify, for expected emitted tokens per second.

    A model draft scores every node with its cumulative draft probability s (the product of the
    draft's probabilities along the path); under greedy verification s estimates the chance that the
    target accepts the whole path, and the expected accepted nodes of a prefix-closed set is the sum
    of their s (for the shipped SPIRe draft on 6 HumanEval prompts, with the drafter instrumented once:
    1.72 predicted against 1.67 accepted tokens a step at n = 3). With nodes in selection order,

        n* = argmax over n in 0..len(scores) of  c * (1 + sum_{i<=n} s_i) / (draft + cost(1 + n)),

    draft = the step's drafting time so far, cost(T) the measured target forward over T tokens
    (engine/batch_cost.py), c a per-sequence calibration: accepted over predicted nodes of the trees
    verified so far (with one pseudo-step of each). On the 2-core CPU a target forward over 38 tokens
    costs 4 one-token steps, so the paper's 36-node trees only pay for a draft accepted 3+ deep.

    The rule may see each node's own score: it must therefore only serve deterministic proposals
    (greedy targets, staged trees verified by sample-walk); recursive rejection sampling needs the
    kept children of a node to be a prefix of their draws whatever they drew.
    """

    costs: Sequence[float]
    _accepted: float = field(init=False, default=1.0)
    _predicted: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        if len(self.costs) < 1 or any(not c > 0 for c in self.costs):
            raise ValueError(f"width costs must be positive, got {list(self.costs)}")
        self.costs = tuple(float(c) for c in self.costs)

    def reset(self) -> None:
        self._accepted = self._predicted = 1.0

    def largest(self) -> int:
        return len(self.costs) - 1  # the largest tree with a known cost

    def choose(self, scores: Sequence[float], draft_seconds: float = 0.0) -> int:
        """How many of the best-first nodes (scores[i]: the (i+1)-th node's cumulative probability) to verify."""
        c = self._accepted / self._predicted
        return best_prefix([c * s for s in scores[: self.largest()]], self.costs, draft_seconds)

    def observe(self, scores: Sequence[float], accepted: int) -> None:
        """The verified nodes' scores, and how many nodes the target accepted."""
        self._predicted += sum(scores)
        self._accepted += accepted
