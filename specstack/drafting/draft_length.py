"""What the draft-length rules (drafting/batch_length.py) share: acceptance rates learned per evidence
class, and `best_prefixes`, the one cost-aware choice of a step's nodes, for one row or many.

Evidence: what predicts a proposed node's acceptance, known before the target's draws (an n-gram's
origin, the length of the context match behind it, its depth, or the node's depth alone). A cost-aware
rule learns one acceptance rate per class online, as a Beta posterior: every node up to the first
rejected one on a verified path is a trial of its class.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

Evidence = Hashable


# Beta pseudo-counts by evidence kind (a tuple class's first element) where even odds are wrong before
# any trial. A grammar's forced token (engine/forced.py) is the only continuation its mask allows: only a
# target that prefers another tokenization of the same bytes rejects it. Started at even odds, a rule on
# a target whose second row costs over half a step would never verify one, and so never learn otherwise.
KIND_PRIORS: dict[Hashable, tuple[float, float]] = {"grammar": (9.0, 1.0)}


@dataclass
class AcceptanceRates:
    """The chance that a node of each evidence class is accepted once its parent is (Beta posterior)."""

    prior: tuple[float, float] = (1.0, 1.0)  # Beta(accepted, rejected) pseudo-counts of every class
    counts: dict[Evidence, list[float]] = field(default_factory=dict)  # class -> [accepted, rejected]

    def __post_init__(self) -> None:
        if not min(self.prior) > 0:
            raise ValueError(f"the Beta prior's pseudo-counts must be positive, got {self.prior}")

    def p(self, cls: Evidence) -> float:
        a, r = self.counts.get(cls, (0.0, 0.0))
        pa, pr = KIND_PRIORS.get(cls[0], self.prior) if isinstance(cls, tuple) and cls else self.prior
        return (a + pa) / (a + r + pa + pr)

    def trial(self, cls: Evidence, accepted: bool) -> None:
        self.counts.setdefault(cls, [0.0, 0.0])[0 if accepted else 1] += 1


def best_prefixes(gains: Sequence[Sequence[float]], cost: Callable[[int], float], emitted: float) -> list[int]:
    """How many of each row's proposed nodes (a prefix, in the row's order) one forward verifies, for
    the most expected emitted tokens per second: gains[r][i] is the expected acceptance row r's
    (i+1)-th node adds, cost(extra) the step's seconds with `extra` draft nodes in all, `emitted`
    the tokens the step emits with none (one per decoding row).

    Nodes are taken greedily, the largest gain next among the rows' next nodes, and the best rate seen
    wins (ties keep the fewer nodes). When each row's gains do not increase along its order (a chain's
    survival probabilities; a tree's nodes best first) this is the exact optimum of
    (emitted + sum of kept gains) / cost(kept) for a cost that depends on the total only: the best
    set of any size m is then the m largest gains."""
    counts = [0] * len(gains)
    best, expected = list(counts), emitted
    best_rate = expected / positive(cost(0))
    heap = [(-g[0], r) for r, g in enumerate(gains) if g]
    heapq.heapify(heap)
    extra = 0
    while heap:
        neg, r = heapq.heappop(heap)
        counts[r] += 1
        extra += 1
        expected -= neg
        rate = expected / positive(cost(extra))
        if rate > best_rate:
            best, best_rate = list(counts), rate
        if counts[r] < len(gains[r]):
            heapq.heappush(heap, (-gains[r][counts[r]], r))
    return best


def positive(seconds: float) -> float:
    if not seconds > 0:
        raise ValueError(f"forward costs must be positive, got {seconds}")
    return seconds
