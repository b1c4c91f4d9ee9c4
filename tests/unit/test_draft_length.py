"""Draft-length rules for one row (a batch of one) worked by hand, through the one protocol
(drafting/batch_length.py: limit, choose, observe, size): BASS's dynamic length (DESIGN §6), the
cost-aware chain length learned per evidence class, and the cost-aware sizing of a best-first tree."""
from __future__ import annotations

import pytest

from specstack.drafting.batch_length import BassLength, CostAwareLength
from specstack.engine.methods import length_rule, parse_method
from specstack.tree import DraftTree


def chain(n: int, evidence: list | None = None, confidence: list[float] | None = None) -> DraftTree:
    tree = DraftTree.chain(list(range(10, 10 + n)))
    tree.evidence = list(evidence) if evidence is not None else tree.evidence
    tree.confidence = list(confidence) if confidence is not None else tree.confidence
    return tree


def step(rule: BassLength, *accepted: int) -> int:
    """One step in which each row was given l nodes and accepted `accepted`; the next l."""
    rule.observe([chain(rule.limit()) for _ in accepted], list(accepted))
    return rule.limit()


def test_grows_by_two_when_a_row_accepts_everything_and_stops_at_the_cap():
    n = BassLength(start=7, cap=12)
    assert n.limit() == 7
    assert step(n, 7) == 9
    assert step(n, 0, 9) == 11  # one row accepting all is enough
    assert step(n, 11) == 12  # capped
    assert step(n, 12) == 12


def test_shrinks_by_a_tenth_and_one_more_after_consecutive_misses():
    n = BassLength(start=20, cap=32)
    assert step(n, 3) == 18  # 20 - ceil(2.0) - 0
    assert step(n, 3) == 15  # 18 - ceil(1.8) - 1
    assert step(n, 3, 14) == 14  # never below the longest accepted run
    assert step(n, 14) == 16  # all accepted: grow, and the extra shrink is forgotten
    assert step(n, 0) == 14  # 16 - ceil(1.6) - 0


def test_never_below_one_and_every_sequence_starts_afresh(tiny_llama):
    n = BassLength(start=2, cap=4)
    assert step(n, 0) == 1
    assert step(n, 0) == 1
    n.observe([], [])  # a step in which no row drafted
    assert n.limit() == 1
    # the rule lives with its engine: each generation gets a new one from the method (bench: one per prompt)
    spec = parse_method("ngram:depth=2,max=4")
    used = length_rule(spec, tiny_llama.lm)
    assert step(used, 0) == 1
    fresh = length_rule(spec, tiny_llama.lm)
    assert fresh.limit() == 2
    assert step(fresh, 0) == 1  # the first miss is not a consecutive one: 2 - 1 - 0


@pytest.mark.parametrize("start,cap", [(0, 4), (5, 4)])
def test_bad_bounds(start, cap):
    with pytest.raises(ValueError, match="start"):
        BassLength(start=start, cap=cap)


# ---- cost-aware chain length ---------------------------------------------------------------------
# costs of a forward over T = 1..5 tokens: flat to 4, then a jump (the int4 CPU target's shape)
COSTS = [1.0, 1.1, 1.2, 1.3, 2.0]


def one_row(costs=COSTS, **kw) -> CostAwareLength:
    """The rule for a lone row over its width curve (costs[T - 1]: a forward over T tokens)."""
    return CostAwareLength(lambda rows, tokens: costs[tokens - 1], longest=len(costs) - 1, **kw)


def pick(rule: CostAwareLength, evidence: list) -> int:
    return rule.choose([chain(len(evidence), evidence)], 1, 1)[0]


def test_cost_aware_verifies_nothing_while_it_knows_nothing_good_and_a_sure_chain_up_to_the_jump():
    n = one_row()  # prior Beta(1, 1): every class at p = 1/2
    # L = 1: (1 + 0.5) / 1.1 = 1.36 beats L = 0 (1.0); L = 2: 1.75 / 1.2 = 1.46; L = 3: 1.875 / 1.3 = 1.44
    assert pick(n, ["a", "a", "a", "a"]) == 2
    for _ in range(8):  # class "a" accepted 8 of 8 times: p = 9 / 10
        n.observe([chain(1, ["a"])], [1])
    # p = 0.9: L = 3 gives (1 + .9 + .81 + .729) / 1.3 = 2.64; L = 4 gives 3.10 / 2.0 = 1.55
    assert pick(n, ["a", "a", "a", "a"]) == 3
    for _ in range(30):  # class "b": rejected 30 times, p = 1 / 32
        n.observe([chain(1, ["b"])], [0])
    assert pick(n, ["b", "a", "a"]) == 0  # a bad first token sinks the chain behind it
    assert pick(n, ["a", "b", "a"]) == 1
    assert pick(n, []) == 0


def test_cost_aware_counts_every_token_up_to_the_first_rejection():
    n = one_row()  # Beta(1, 1): p = (accepted + 1) / (trials + 2)
    n.observe([chain(3, ["x", "y", "z"])], [1])  # x accepted, y rejected, z never reached
    n.observe([chain(2, ["x", "y"])], [2])  # both accepted
    assert n.rates.p("x") == 3 / 4
    assert n.rates.p("y") == 2 / 4
    assert n.rates.p("z") == 1 / 2  # no trial: the prior
    # a chain without evidence (or drawn from q) is learned by depth instead
    n.observe([chain(3)], [1])
    assert n.rates.p(1) == 2 / 3 and n.rates.p(2) == 1 / 3 and n.rates.p("x") == 3 / 4


def test_cost_aware_limit_is_what_the_costs_cover_and_bad_costs_are_refused():
    assert one_row().limit() == 4
    assert pick(one_row(), ["a"] * 9) <= 4
    with pytest.raises(ValueError, match="positive"):
        pick(one_row([1.0, 0.0]), ["a"])
    with pytest.raises(ValueError, match="prior"):
        one_row(prior=(0.0, 1.0))


# ---- cost-aware tree size ------------------------------------------------------------------------
def best_first(scores: list[float]) -> DraftTree:
    """A best-first tree's nodes (any shape: a chain here), each carrying its cumulative draft probability."""
    return chain(len(scores), confidence=scores)


def test_tree_size_keeps_the_nodes_that_pay_for_their_width():
    b = one_row()
    # n = 1: 1.9 / 1.1 = 1.73; n = 2: 2.6 / 1.2 = 2.17; n = 3: 2.8 / 1.3 = 2.15; n = 4: 2.9 / 2.0
    assert b.size([0.9, 0.7, 0.2, 0.1]) == 2 and b.choose([best_first([0.9, 0.7, 0.2, 0.1])], 1, 1) == [2]
    assert b.size([0.9, 0.7, 0.5, 0.4]) == 3  # n = 3: 3.1 / 1.3 = 2.38 against 2.6 / 1.2 = 2.17
    assert b.size([0.05, 0.04]) == 0  # unlikely nodes are not worth the wider forward
    assert b.size([]) == 0
    assert b.limit() == 4 and b.size([0.99] * 9) <= 4


def test_time_already_spent_drafting_makes_the_wider_forward_relatively_cheaper():
    now = [0.0]
    b = one_row(clock=lambda: now[0])
    b.limit()  # the step's drafting begins
    now[0] = 1.0  # a second of it so far
    # n = 3: 2.8 / 2.3 = 1.217 beats n = 2: 2.6 / 2.2 = 1.182
    assert b.size([0.9, 0.7, 0.2, 0.1]) == 3
    assert b.choose([best_first([0.9, 0.7, 0.2, 0.1])], 1, 1) == [3]


def test_tree_size_calibrates_the_draft_probabilities():
    b = one_row()
    for _ in range(20):  # a draft that claims 0.8 for its first node and is never right
        b.observe([best_first([0.8])], [0])
    assert b.size([0.8, 0.6]) == 0  # c = 1 / 17: its scores are no longer believed
    assert b.choose([best_first([0.8, 0.6])], 1, 1) == [0]
    assert one_row().size([0.8, 0.6]) == 2  # a new rule (a new sequence) believes them again
