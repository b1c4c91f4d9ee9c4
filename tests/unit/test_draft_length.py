"""Draft-length rules worked by hand: BASS's dynamic length (DESIGN §6) and the cost-aware choice."""
from __future__ import annotations

import pytest

from specstack.drafting.draft_length import (
    CostAwareBudget,
    CostAwareLength,
    DynamicDraftLength,
)


def test_grows_by_two_when_a_row_accepts_everything_and_stops_at_the_cap():
    n = DynamicDraftLength(start=7, cap=12)
    assert n.value == 7
    assert n.update([7]) == 9
    assert n.update([0, 9]) == 11  # one row accepting all is enough
    assert n.update([11]) == 12  # capped
    assert n.update([12]) == 12


def test_shrinks_by_a_tenth_and_one_more_after_consecutive_misses():
    n = DynamicDraftLength(start=20, cap=32)
    assert n.update([3]) == 18  # 20 - ceil(2.0) - 0
    assert n.update([3]) == 15  # 18 - ceil(1.8) - 1
    assert n.update([3, 14]) == 14  # never below the longest accepted run
    assert n.update([14]) == 16  # all accepted: grow, and the extra shrink is forgotten
    assert n.update([0]) == 14  # 16 - ceil(1.6) - 0


def test_never_below_one_and_reset_restores_the_start():
    n = DynamicDraftLength(start=2, cap=4)
    assert n.update([0]) == 1
    assert n.update([0]) == 1
    assert n.update([]) == 1  # a step in which no row drafted
    n.reset()
    assert n.value == 2
    assert n.update([0]) == 1  # after reset, the first miss is not a consecutive one: 2 - 1 - 0


@pytest.mark.parametrize("start,cap", [(0, 4), (5, 4)])
def test_bad_bounds(start, cap):
    with pytest.raises(ValueError, match="start"):
        DynamicDraftLength(start=start, cap=cap)


# ---- cost-aware length ---------------------------------------------------------------------------
# costs of a forward over T = 1..5 tokens: flat to 4, then a jump (the int4 CPU target's shape)
COSTS = [1.0, 1.1, 1.2, 1.3, 2.0]


def test_cost_aware_verifies_nothing_while_it_knows_nothing_good_and_a_sure_chain_up_to_the_jump():
    n = CostAwareLength(COSTS)  # prior Beta(1, 1): every class at p = 1/2
    # L = 1: (1 + 0.5) / 1.1 = 1.36 beats L = 0 (1.0); L = 2: 1.75 / 1.2 = 1.46; L = 3: 1.875 / 1.3 = 1.44
    assert n.choose(["a", "a", "a", "a"]) == 2
    for _ in range(8):  # class "a" accepted 8 of 8 times: p = 9 / 10
        n.observe(["a"], 1)
    # p = 0.9: L = 3 gives (1 + .9 + .81 + .729) / 1.3 = 2.64; L = 4 gives 3.10 / 2.0 = 1.55
    assert n.choose(["a", "a", "a", "a"]) == 3
    for _ in range(30):  # class "b": rejected 30 times, p = 1 / 32
        n.observe(["b"], 0)
    assert n.choose(["b", "a", "a"]) == 0  # a bad first token sinks the chain behind it
    assert n.choose(["a", "b", "a"]) == 1
    assert n.choose([]) == 0


def test_cost_aware_counts_every_token_up_to_the_first_rejection():
    n = CostAwareLength(COSTS)  # Beta(1, 1): p = (accepted + 1) / (trials + 2)
    n.observe(["x", "y", "z"], 1)  # x accepted, y rejected, z never reached
    n.observe(["x", "y"], 2)  # both accepted
    assert n.p("x") == 3 / 4
    assert n.p("y") == 2 / 4
    assert n.p("z") == 1 / 2  # no trial: the prior
    n.reset()
    assert n.p("x") == 1 / 2


def test_cost_aware_longest_is_what_the_costs_cover_and_bad_costs_are_refused():
    assert CostAwareLength(COSTS).longest() == 4
    assert CostAwareLength(COSTS).choose(["a"] * 9) <= 4
    with pytest.raises(ValueError, match="positive"):
        CostAwareLength([1.0, 0.0])
    with pytest.raises(ValueError, match="positive"):
        CostAwareLength([])
    with pytest.raises(ValueError, match="prior"):
        CostAwareLength(COSTS, prior=(0.0, 1.0))


# ---- cost-aware tree budget ----------------------------------------------------------------------
def test_tree_budget_keeps_the_nodes_that_pay_for_their_width():
    b = CostAwareBudget(COSTS)
    # n = 1: 1.9 / 1.1 = 1.73; n = 2: 2.6 / 1.2 = 2.17; n = 3: 2.8 / 1.3 = 2.15; n = 4: 2.9 / 2.0
    assert b.choose([0.9, 0.7, 0.2, 0.1]) == 2
    assert b.choose([0.9, 0.7, 0.5, 0.4]) == 3  # n = 3: 3.1 / 1.3 = 2.38 against 2.6 / 1.2 = 2.17
    assert b.choose([0.05, 0.04]) == 0  # unlikely nodes are not worth the wider forward
    assert b.choose([]) == 0
    # time already spent drafting makes the wider forward relatively cheaper:
    # n = 3: 2.8 / 2.3 = 1.217 beats n = 2: 2.6 / 2.2 = 1.182
    assert b.choose([0.9, 0.7, 0.2, 0.1], draft_seconds=1.0) == 3
    assert b.largest() == 4 and b.choose([0.99] * 9) <= 4


def test_tree_budget_calibrates_the_draft_probabilities_per_sequence():
    b = CostAwareBudget(COSTS)
    for _ in range(20):  # a draft that claims 0.8 for its first node and is never right
        b.observe([0.8], 0)
    assert b.choose([0.8, 0.6]) == 0  # c = 1 / 17: its scores are no longer believed
    b.reset()
    assert b.choose([0.8, 0.6]) == 2
    with pytest.raises(ValueError, match="positive"):
        CostAwareBudget([1.0, -1.0])
