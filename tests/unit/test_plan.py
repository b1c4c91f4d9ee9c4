"""The step planner and the request lifecycle (engine/plan.py), without a model: hand-made rows in, the
step's admissions, prompt chunks and draft nodes out, under one token budget."""
from __future__ import annotations

import pytest

from specstack.engine.plan import LifecycleError, RowState, RowView, plan_step, transition

W, P, D = RowState.WAITING, RowState.PREFILLING, RowState.DECODING


def decoding(handle: int, drafts: bool = True, room: int = 1000) -> RowView:
    return RowView(handle, D, pending=1, drafts=drafts, room=room)


def prompt(handle: int, tokens: int, drafts: bool = False, state: RowState = P, holds_root: bool = False) -> RowView:
    return RowView(handle, state, pending=tokens, drafts=drafts, room=1000, holds_root=holds_root)


def test_roots_come_first_then_prompts_then_trees_share_what_is_left():
    rows = [decoding(0), decoding(1), prompt(2, 10)]
    plan = plan_step(rows, [], free_rows=0, budget=20, max_tree=64)
    assert plan.reads == {0: 1, 1: 1, 2: 10}
    assert plan.drafts == {0: 4, 1: 4}  # 20 - 2 roots - 10 prompt tokens, shared evenly
    assert plan.tokens == 20


def test_the_oldest_prompt_is_read_first_and_a_long_prompt_is_chunked():
    rows = [prompt(7, 50), prompt(3, 50), decoding(5, drafts=False)]  # slot order is not age order
    plan = plan_step(rows, [], free_rows=0, budget=16, max_tree=64)
    assert plan.reads == {5: 1, 3: 15, 7: 0}
    assert plan.drafts == {}


def test_speculative_tokens_shrink_while_prompts_wait():
    rows = [decoding(0), decoding(1)]
    alone = plan_step(rows, [], free_rows=2, budget=40, max_tree=64)
    queued = plan_step(rows, [prompt(2, 30, state=W)], free_rows=2, budget=40, max_tree=64)
    assert alone.drafts == {0: 19, 1: 19}
    assert queued.admit == 1 and queued.reads[2] == 30
    assert queued.drafts == {0: 4, 1: 4}
    starved = plan_step(rows, [prompt(2, 100, state=W)], free_rows=2, budget=40, max_tree=64)
    assert starved.drafts == {0: 0, 1: 0} and starved.reads[2] == 38


def test_trees_are_capped_by_max_tree_and_by_the_rows_room():
    rows = [decoding(0, room=3), decoding(1), decoding(2)]
    plan = plan_step(rows, [], free_rows=0, budget=300, max_tree=16)
    assert plan.drafts == {0: 3, 1: 16, 2: 16}


def test_the_remainder_of_the_draft_budget_goes_to_the_oldest_rows():
    rows = [decoding(4), decoding(2), decoding(9)]
    plan = plan_step(rows, [], free_rows=0, budget=3 + 8, max_tree=64)
    assert plan.drafts == {2: 3, 4: 3, 9: 2}


def test_a_row_reads_its_root_with_its_prompt_unless_its_drafter_reads_the_prompts_activations():
    rows = [prompt(0, 10, drafts=True, holds_root=True), prompt(1, 10, drafts=True), prompt(2, 10)]
    plan = plan_step(rows, [], free_rows=0, budget=100, max_tree=64)
    assert plan.reads == {0: 9, 1: 10, 2: 10}  # the SPIRe row holds its root back for its first tree
    assert plan.drafts == {}  # the others' first trees come with their first tokens, in the next step
    waiting = [prompt(3, 1, drafts=True, state=W), prompt(4, 10, drafts=True, state=W, holds_root=True)]
    plan = plan_step([], waiting, free_rows=2, budget=100, max_tree=64)
    assert plan.reads == {3: 1, 4: 9} and plan.drafts == {3: 64}  # a one-token prompt: its root and a tree


def test_a_full_cache_refuses_and_the_queue_keeps_its_order():
    rows = [decoding(0), decoding(1)]
    waiting = [prompt(2, 5, state=W), prompt(3, 5, state=W)]
    assert plan_step(rows, waiting, free_rows=0, budget=64, max_tree=8).admit == 0
    plan = plan_step(rows, waiting, free_rows=1, budget=64, max_tree=8)
    assert plan.admit == 1 and 2 in plan.reads and 3 not in plan.reads


def test_requests_take_free_rows_even_when_the_budget_is_spent():
    rows = [decoding(0, drafts=False), prompt(1, 100)]
    plan = plan_step(rows, [prompt(2, 5, state=W)], free_rows=1, budget=8, max_tree=8)
    assert plan.admit == 1 and plan.reads == {0: 1, 1: 7, 2: 0}


def test_roots_are_never_cut_by_a_small_budget():
    rows = [decoding(i) for i in range(5)]
    plan = plan_step(rows, [prompt(9, 3, state=W)], free_rows=1, budget=2, max_tree=8)
    assert all(plan.reads[i] == 1 for i in range(5))
    assert plan.reads[9] == 0 and plan.drafts == dict.fromkeys(range(5), 0)


def test_a_one_token_prompt_decodes_at_once():
    plan = plan_step([], [RowView(0, W, pending=1, drafts=True, room=50)], free_rows=1, budget=10, max_tree=64)
    assert plan.reads == {0: 1} and plan.drafts == {0: 9}


@pytest.mark.parametrize("state", [W, P, D])
def test_a_request_may_be_cancelled_in_every_live_state(state):
    assert transition(state, RowState.CANCELLED) is RowState.CANCELLED


@pytest.mark.parametrize("state", [RowState.FINISHED, RowState.CANCELLED])
def test_an_ended_request_never_changes_again(state):
    for to in RowState:
        with pytest.raises(LifecycleError):
            transition(state, to)


def test_the_lifecycle_moves_forward_only():
    assert transition(W, P) is P and transition(P, D) is D and transition(D, RowState.FINISHED) is RowState.FINISHED
    assert transition(W, D) is D  # a one-token prompt
    assert transition(P, RowState.FINISHED) is RowState.FINISHED  # the first token ended it
    for back in ((D, P), (P, W), (D, W)):
        with pytest.raises(LifecycleError, match="cannot become"):
            transition(*back)


def test_a_held_request_takes_a_row_but_reads_nothing_while_the_budget_goes_on():
    """Samples of one prompt: the oldest reads it, the held ones wait (to copy it from the prefix cache)
    and leave the budget to the rest."""
    rows = [prompt(0, 70), RowView(1, P, pending=70, drafts=False, held=True)]
    waiting = [RowView(2, W, pending=70, drafts=False, held=True), prompt(3, 5, state=W)]
    plan = plan_step(rows, waiting, free_rows=2, budget=80, max_tree=64)
    assert plan.admit == 2 and plan.reads == {0: 70, 1: 0, 3: 5}
