"""The batched engine's lifecycle and its refusals (engine/batched.py, cache.py rows): bad requests
are refused with a clear error before they touch the batch, and the rows already decoding go on
unharmed; the cache's rows are allocated once and freed rows are reused."""
from __future__ import annotations

import pytest
import torch

from specstack.config import GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest, generate
from specstack.errors import SpecstackError

GEN = GenerationConfig(max_new_tokens=6, stop_on_eos=False)


def test_bad_requests_are_refused_and_the_batch_goes_on(tiny_llama):
    lm = tiny_llama.lm
    engine = BatchEngine(lm, max_rows=2, max_context=32)
    ok = engine.add(BatchRequest([5, 6, 7], GEN))
    engine.step()
    with pytest.raises(SpecstackError, match="empty"):
        engine.add(BatchRequest([], GEN))
    with pytest.raises(SpecstackError, match="context limit of 32"):
        engine.add(BatchRequest(list(range(3, 35)), GEN))
    queued = engine.add(BatchRequest([9, 9], GEN))  # joins: a free row
    engine.step()
    waiting = engine.add(BatchRequest([8], GEN))  # both rows busy: it waits
    assert engine.waiting == 1
    while engine.busy:
        engine.step()
    for h, p in ((ok, [5, 6, 7]), (queued, [9, 9]), (waiting, [8])):
        assert engine.pop_result(h).tokens == generate(lm, p, GEN).tokens


@pytest.mark.parametrize("kwargs, match", [(dict(max_rows=0), "at least one row"),
                                           (dict(layout="diagonal"), "unknown layout"),
                                           (dict(step_tokens=0), "token budget"),
                                           (dict(max_context=1), "at least 2 tokens")])
def test_bad_engine_settings(tiny_llama, kwargs, match):
    with pytest.raises(SpecstackError, match=match):
        BatchEngine(tiny_llama.lm, **kwargs)


def test_a_batch_over_the_memory_budget_is_refused(tiny_llama):
    from specstack.engine.batched import kv_cache_bytes
    from specstack.validate import MAX_TREE

    need = kv_cache_bytes(tiny_llama.lm, 8, 64 + MAX_TREE + 1)  # 8 rows of 64 tokens plus a tree's scratch
    BatchEngine(tiny_llama.lm, max_rows=8, max_context=64, max_kv_bytes=need)
    with pytest.raises(SpecstackError, match=r"KV cache for 8 rows of 64 tokens needs .* over the budget"):
        BatchEngine(tiny_llama.lm, max_rows=8, max_context=64, max_kv_bytes=need - 1)


def test_max_new_tokens_capped_by_the_row_context(tiny_llama):
    engine = BatchEngine(tiny_llama.lm, max_rows=1, max_context=20)
    out = engine.run([BatchRequest(list(range(3, 18)), GenerationConfig(max_new_tokens=50, stop_on_eos=False))])[0]
    assert len(out.tokens) == 5 and out.finish_reason == "length"


def test_cache_rows_are_allocated_once_and_reused(tiny_llama):
    model = tiny_llama.lm.model
    cache = model.new_cache(0, 16, max_rows=3)
    k_ptr = cache.k.data_ptr()
    rows = [cache.add_row() for _ in range(3)]
    assert rows == [0, 1, 2]
    with pytest.raises(SpecstackError, match="all 3 rows"):
        cache.add_row()
    for r, n in enumerate((2, 5, 3)):  # distinct contents per row
        cache.k[:, r, :, :n] = r + 1
        cache.lengths[r] = cache.next_pos[r] = n
    assert cache.remove_row(0) == 2  # the last row moves into the freed slot
    assert cache.lengths == [3, 5] and torch.all(cache.k[:, 0, :, :3] == 3)
    assert cache.remove_row(1) is None and cache.lengths == [3]
    assert cache.add_row() == 1 and cache.lengths == [3, 0]
    assert cache.k.data_ptr() == k_ptr


def test_prompts_are_read_oldest_request_first(tiny_llama):
    """The step's token budget left by the roots goes to the oldest request still reading its prompt, whatever its slot:
    when A leaves, the newest row C moves into A's slot, ahead of B in slot order, yet B (older, and
    ahead by one chunk) gets its first token first. In slot order C would take every chunk until done."""
    lm = tiny_llama.lm
    engine = BatchEngine(lm, max_rows=3, max_context=64, step_tokens=4)
    a = engine.add(BatchRequest([5], GenerationConfig(max_new_tokens=1, stop_on_eos=False)))
    b = engine.add(BatchRequest(list(range(3, 23)), GEN))
    c = engine.add(BatchRequest(list(range(4, 24)), GEN))
    assert [h for h, _ in engine.step()] == [a]  # A decoded at once; B read a chunk, C nothing
    assert [row.handle for row in engine.rows] == [c, b]  # C took A's slot
    while not any(engine.emitted().values()):
        engine.step()
    assert engine.emitted() == {b: 1, c: 0}
    while engine.busy:
        engine.step()
    for h, p in ((b, list(range(3, 23))), (c, list(range(4, 24)))):
        assert engine.pop_result(h).tokens == generate(lm, p, GEN).tokens


def _row_state(engine: BatchEngine, handle: int):
    return next(r.state for r in list(engine.rows) + list(engine.queue) if r.handle == handle)


def test_a_request_is_cancelled_in_every_state_and_its_row_serves_the_next(tiny_llama):
    """Waiting, reading its prompt, decoding: cancel frees the request's place at once; a finished or
    unknown request cannot be cancelled; the requests left decode as they would alone."""
    from specstack.engine.plan import RowState

    lm = tiny_llama.lm
    engine = BatchEngine(lm, max_rows=2, max_context=64, step_tokens=4)
    decoding = engine.add(BatchRequest([5, 6], GEN))
    reading = engine.add(BatchRequest(list(range(3, 30)), GEN))
    waiting = engine.add(BatchRequest([7, 8, 9], GEN))
    engine.step()
    engine.step()
    assert [_row_state(engine, h) for h in (decoding, reading, waiting)] == [
        RowState.DECODING, RowState.PREFILLING, RowState.WAITING]
    for h in (waiting, reading, decoding):
        assert engine.cancel(h)
        assert not engine.cancel(h)  # once only
    assert not engine.busy and engine.cache.batch_size == 0
    last = engine.add(BatchRequest([4, 4, 4], GEN))
    while engine.busy:
        engine.step()
    result = engine.pop_result(last)
    assert result.tokens == generate(lm, [4, 4, 4], GEN).tokens
    assert not engine.cancel(last)  # finished: nothing to cancel
    assert engine.pop_result(decoding) is None  # a cancelled request leaves no result behind


def test_engine_stats_stay_bounded_over_many_steps(tiny_llama, monkeypatch):
    """A server's engine steps for days: totals grow, the remembered steps do not."""
    import specstack.engine.stats as stats

    monkeypatch.setattr(stats, "HISTORY", 5)
    engine = BatchEngine(tiny_llama.lm, max_rows=2, max_context=64)
    gen = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine.run([BatchRequest([3, 4, 5], gen), BatchRequest([6, 7], gen)])
    st = engine.stats
    assert st.steps >= 20 and len(st.recent) == 5
    assert st.rows >= 2 * 19 and st.tokens >= st.rows  # totals cover every step
    assert sum(st.layouts.values()) == st.steps
    assert st.last == st.recent[-1]


class _Idle:
    """A drafter that never proposes (the engine then decodes as ar): it records the rows it served."""

    target_layers = ()
    group = None

    def __init__(self, served: list) -> None:
        self.served = served

    def reset(self, prompt_ids, target_hidden=None) -> None:
        self.served.append(list(prompt_ids))

    def propose(self, ctx):
        from specstack.tree import DraftTree

        return DraftTree()

    def observe(self, tree, result, target_hidden=None) -> None:
        pass


def test_drafters_are_lent_from_one_pool_per_factory_and_reused(tiny_llama):
    """A row whose request brings no drafter is lent one from its factory's pool (the engine's, or the
    request's method's); a row that leaves gives it back and the next row of that factory reuses it."""
    made: dict[str, list[_Idle]] = {"engine": [], "other": []}
    served: list = []

    def factory(name):
        def make():
            made[name].append(_Idle(served))
            return made[name][-1]
        return make

    engine_make, other_make = factory("engine"), factory("other")
    engine = BatchEngine(tiny_llama.lm, max_rows=1, max_context=32, drafters=engine_make)  # one row at a time
    gen = GenerationConfig(max_new_tokens=3, stop_on_eos=False)
    requests = [BatchRequest([3, 4], gen), BatchRequest([5, 6], gen, drafter_factory=other_make),
                BatchRequest([7, 8], gen), BatchRequest([9, 9], gen, speculate=False), BatchRequest([2, 3], gen)]
    outs = engine.run(requests)
    assert len(made["engine"]) == 1 and len(made["other"]) == 1  # each made once, then reused
    assert [p for p in served] == [[3, 4], [5, 6], [7, 8], [2, 3]]  # the opted-out row had none
    for r, o in zip(requests, outs, strict=True):
        assert o.tokens == generate(tiny_llama.lm, r.prompt_ids, gen).tokens


def test_engine_tau_counts_rounds_whatever_they_drafted(tiny_llama):
    """τ (tokens a row gains per round) counts every verification, those of rows whose length rule kept
    fewer nodes than their drafter proposed, or none: a perfect draft cut to 2 nodes gives exactly 3,
    plain rows 1, and both side by side their pooled share."""
    from specstack.drafting.batch_length import FixedLength
    from specstack.drafting.model import chain_members

    gen = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]

    def run(speculate: list[bool]):
        member = chain_members(tiny_llama.lm, 4)  # the target drafting for itself: every node accepted
        engine = BatchEngine(tiny_llama.lm, max_rows=3, max_context=64, length=FixedLength(2))
        engine.run([BatchRequest(p, gen, drafter=member() if s else None, speculate=s)
                    for p, s in zip(prompts, speculate, strict=True)])
        return engine.stats

    st = run([True] * 3)
    assert st.drafted == 2 * st.verified and st.accepted == st.drafted and st.tau == 3.0
    assert run([False] * 3).tau == 1.0
    mixed = run([True, False, True])
    plain_rounds = mixed.verified - mixed.drafted // 2
    assert mixed.emitted == 3 * (mixed.drafted // 2) + plain_rounds
    assert 1.0 < mixed.tau < 3.0


def test_what_drafters_learn_reaches_the_step_length_rule(tiny_llama):
    """A drafter's lessons (ctx.lessons: its verdicts on nodes cut unverified) go to the step's length rule
    before it chooses, each once, from every row that drafted."""
    from specstack.drafting.batch_length import AsProposed

    class Teaching(_Idle):
        def propose(self, ctx):
            ctx.lessons.append((len(self.served), len(ctx.tokens)))
            return super().propose(ctx)

    class Learning(AsProposed):
        def __init__(self) -> None:
            super().__init__()
            self.learned: list = []

        def learn(self, lessons) -> None:
            self.learned += lessons

    rule = Learning()
    served: list = []
    engine = BatchEngine(tiny_llama.lm, max_rows=2, max_context=32, length=rule)
    engine.run([BatchRequest([5, 6, 7], GEN, drafter=Teaching(served)),
                BatchRequest([9, 9], GEN, drafter=Teaching(served))])
    # each row's drafter proposes once a step, from its first token on (6 tokens: 6 steps each)
    assert sorted(n for _, n in rule.learned) == sorted([3 + s for s in range(6)] + [2 + s for s in range(6)])


@pytest.mark.parametrize("shared", [True, False], ids=["group", "row-by-row"])
def test_a_tree_group_runs_one_draft_forward_a_level_for_all_rows(tiny_llama, shared):
    """B rows drafting trees of depth D (levels of full width: each expands every node of its depth) cost
    the draft D forwards a step (the catch-up, then D - 1 levels; one more in the step a row's prompt is
    read ahead) in a TreeGroup (drafting/batched_tree.py), and B x D row by row (each drafter a group of
    its own); the step's stats count them."""
    from specstack.drafting.batched_tree import TreeGroup
    from specstack.drafting.model import ModelDrafter, TreeParams

    lm, rows, depth = tiny_llama.lm, 4, 3
    params = TreeParams(width=2, budget=14, depth=depth, expand_per_forward=14)  # 2 + 4 + 8 nodes: all kept
    group = TreeGroup(lm)
    drafters = [ModelDrafter(lm, params, group=group) if shared else ModelDrafter(lm, params) for _ in range(rows)]
    prompts = [[7 + i] * (3 + 4 * i) for i in range(rows)]  # ragged: 3 to 15 tokens
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    engine = BatchEngine(lm, max_rows=rows, max_context=64, step_tokens=rows * (1 + params.budget))
    results = engine.run([BatchRequest(p, gen, drafter=d) for p, d in zip(prompts, drafters, strict=True)])
    assert [r.tokens for r in results] == [generate(lm, p, gen).tokens for p in prompts]
    full = [s.draft_forwards for s in engine.stats.recent if s.drafted == rows * params.budget]
    assert len(full) >= 3  # steps in which every row drafted its whole tree
    if shared:
        assert full[0] in (depth, depth + 1) and full[1:] == [depth] * (len(full) - 1)
    else:
        assert full == [rows * depth] * len(full)
    assert engine.stats.draft_forwards == sum(s.draft_forwards for s in engine.stats.recent)


@pytest.mark.parametrize("shared", [True, False], ids=["group", "row-by-row"])
def test_staged_rows_of_a_group_share_each_spine_step(tiny_llama, shared):
    """B rows drafting staged trees (each spine step a token and draft2's tree under it, of different
    widths from row to row) cost the draft at most the catch-up and D spine steps a step in a TreeGroup
    (one more in the step a prompt is read ahead), and up to B times that row by row; every row's output
    is its prompt's greedy decode."""
    from unit.test_tree import Successors

    from specstack.drafting.batched_tree import TreeGroup
    from specstack.drafting.model import TreeParams
    from specstack.drafting.staged import StagedDrafter

    lm, rows, depth = tiny_llama.lm, 4, 3
    params = TreeParams(width=2, budget=12, depth=depth)
    group = TreeGroup(lm) if shared else None
    drafters = [StagedDrafter(lm, Successors(), params, widths=(3, 1), group=group) for _ in range(rows)]
    prompts = [[7 + i] * (3 + 4 * i) for i in range(rows)]
    gen = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine = BatchEngine(lm, max_rows=rows, max_context=96, step_tokens=rows * (1 + params.budget))
    results = engine.run([BatchRequest(p, gen, drafter=d) for p, d in zip(prompts, drafters, strict=True)])
    assert [r.tokens for r in results] == [generate(lm, p, gen).tokens for p in prompts]
    forwards = [s.draft_forwards for s in engine.stats.recent]
    if shared:
        assert 0 < max(forwards) <= depth + 2
    else:
        assert max(forwards) > depth + 2  # the bound a group keeps is not one row by row keeps


def decode_group(lm, rule, drafters, budget: int) -> tuple[BatchEngine, list[list[int]]]:
    """A row a drafter, prompts [7 + i] * (3 + 2 i), 20 tokens each under the length rule `rule`: every
    row's output is its prompt's greedy decode. The engine (its stats) and the prompts."""
    rows = len(drafters)
    prompts = [[7 + i] * (3 + 2 * i) for i in range(rows)]
    gen = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine = BatchEngine(lm, max_rows=rows, max_context=64, length=rule, step_tokens=rows * (1 + budget))
    results = engine.run([BatchRequest(p, gen, drafter=d) for p, d in zip(prompts, drafters, strict=True)])
    assert [r.tokens for r in results] == [generate(lm, p, gen).tokens for p in prompts]
    return engine, prompts


@pytest.mark.parametrize("rows", [1, 3])
def test_a_paused_drafter_runs_no_draft_forward_until_it_drafts_again(tiny_llama, rows):
    """While the length rule pauses drafting (limit 0) the draft model runs nothing, however many tokens
    wait (they are caught up on, read ahead in a group, when drafting resumes), and every row's output is
    still its prompt's greedy decode."""
    from specstack.drafting.batch_length import FixedLength
    from specstack.drafting.batched_tree import TreeGroup
    from specstack.drafting.model import ModelDrafter, TreeParams

    class Paused(FixedLength):
        """Drafting in steps 0-2 and from step 11 on, paused in between (longer than a tree's depth)."""

        def __init__(self) -> None:
            super().__init__(None)
            self.limits: list[int | None] = []

        def limit(self, shape=None) -> int | None:
            self.limits.append(0 if 3 <= len(self.limits) < 11 else None)
            return self.limits[-1]

    lm, params = tiny_llama.lm, TreeParams(width=2, budget=6, depth=3)
    group = TreeGroup(lm)
    rule = Paused()
    engine, _ = decode_group(lm, rule, [ModelDrafter(lm, params, group=group) for _ in range(rows)], params.budget)
    steps = list(engine.stats.recent)  # the rule is asked once a step
    assert len(steps) == len(rule.limits) > 12
    paused = [s.draft_forwards for s, limit in zip(steps, rule.limits, strict=True) if limit == 0]
    assert len(paused) == 8 and paused == [0] * 8
    assert steps[11].draft_forwards > 0 and steps[11].drafted > 0  # it drafts again, the backlog caught up


def test_a_trial_drafts_with_the_first_rooted_row_only(tiny_llama):
    """While the rule tries drafting with one row (trial() == 1), only the first row that reached its
    root drafts: the others' drafters run nothing, their prompts unread by the draft, until the rule lets
    every row draft; every row's output is still its prompt's greedy decode. (A row reading its prompt's
    last chunk is not rooted yet: its drafter is asked for nothing and runs nothing.)"""
    from specstack.drafting.batch_length import FixedLength
    from specstack.drafting.batched_tree import TreeGroup
    from specstack.drafting.model import ModelDrafter, TreeParams

    class Trial(FixedLength):
        """One row drafts in steps 1-5, every row after."""

        def __init__(self) -> None:
            super().__init__(None)
            self.steps = 0

        def limit(self, shape=None) -> int | None:
            self.steps += 1
            return None

        def trial(self) -> int | None:
            return 1 if self.steps <= 5 else None

    class Logged(ModelDrafter):
        def begin(self, ctx):
            ran = super().begin(ctx)
            log.append((rule.steps, self.row, ran, len(self.state.pending[self.row]), len(ctx.tokens)))
            return ran

    log: list[tuple[int, int, bool, int, int]] = []
    lm, params = tiny_llama.lm, TreeParams(width=2, budget=4, depth=2)
    group = TreeGroup(lm)
    drafters = [Logged(lm, params, group=group) for _ in range(3)]
    rule = Trial()
    _, prompts = decode_group(lm, rule, drafters, params.budget)
    size = {d.row: len(p) for d, p in zip(drafters, prompts, strict=True)}
    ends = [(step, row) for step, row, ran, _, n in log if n == size[row]]  # prompts' last chunks
    assert len(ends) == len(drafters) and not any(ran for _, row, ran, _, n in log if n == size[row])
    log = [entry for entry in log if entry[4] > size[entry[1]]]
    trial = [[ran for step, _, ran, _, _ in log if step == s] for s in range(1, 6)]
    assert sum(map(len, trial)) >= 10  # rows reached their roots in the trial steps
    assert all(ran == [True] + [False] * (len(ran) - 1) for ran in trial if ran)  # the first row alone
    later = {row for step, row, ran, _, _ in log if step > 5 and ran}
    assert later == {d.row for d in drafters}  # every row drafts once the trial is over
    # the other rows' prompts waited unread: their first round read all of it ahead
    firsts = [next(p for step, r, ran, p, _ in log if r == d.row and ran) for d in drafters[1:]]
    assert all(p >= len(prompt) for p, prompt in zip(firsts, prompts[1:], strict=True))
