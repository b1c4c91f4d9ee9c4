"""Speculation in a batch (BASS; engine/batched.py, drafting/batch_length.py) is lossless row by row: in
fp32 every row's greedy output equals that prompt decoded alone, for every drafter (n-gram chains and
trees, a draft model's chains and trees, staged, MagicDec's window, a SPIRe draft reading the
target's activations), rows of very different acceptance (a perfect draft, a partial one, a random
one) side by side, PAD and SPLIT, every draft-length rule, rows joining mid-flight as others leave,
and drafters reused from a finished row by the next request."""
from __future__ import annotations

import random

import pytest
from lossless.test_greedy_equality import RandomProposals

from specstack.config import GenerationConfig
from specstack.drafting.batch_length import AsProposed, BassLength, CostAwareLength, FixedLength
from specstack.drafting.batched_tree import TreeGroup
from specstack.drafting.katz import KatzTrigram
from specstack.drafting.model import ChainDrafter, ModelDrafter, TreeParams, chain_members
from specstack.drafting.ngram import STAGED_WIDTHS, NgramDrafter
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import BatchEngine, BatchRequest, generate
from specstack.engine.methods import DraftSources, resolve_draft

pytestmark = pytest.mark.usefixtures("one_thread")

_rnd = random.Random(20)
PROMPTS = [[_rnd.randrange(3, 257) for _ in range(n)] for n in (1, 40, 3, 17, 6, 25, 2, 9)]
GEN = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
_alone: dict[tuple, list[int]] = {}


def alone(lm, prompt: list[int], gen: GenerationConfig = GEN) -> list[int]:
    key = (id(lm), tuple(prompt), gen)
    if key not in _alone:
        _alone[key] = generate(lm, prompt, gen).tokens
    return _alone[key]


def cost(rows: int, tokens: int) -> float:
    """A forward's cost: a row costs 1, a token 0.3 more up to 4 a row, then 0.8 (the int4 CPU's shape)."""
    return rows + 0.3 * min(tokens - rows, 3 * rows) + 0.8 * max(0, tokens - 4 * rows)


RULES = {"proposed": AsProposed, "fixed2": lambda: FixedLength(2), "bass": lambda: BassLength(3, 8),
         "cost": lambda: CostAwareLength(cost), "cost-pause": lambda: CostAwareLength(cost, pause=True)}


def run_batch(lm, drafters, rule, layout, prompts=PROMPTS, max_rows=4, gen=GEN):
    engine = BatchEngine(lm, max_rows=max_rows, max_context=160, layout=layout, step_tokens=48, length=rule)
    requests = [BatchRequest(p, gen, drafter=d) for p, d in zip(prompts, drafters, strict=True)]
    return engine, engine.run(requests)


def check(lm, prompts, results, what):
    for i, (p, out) in enumerate(zip(prompts, results, strict=True)):
        assert out.tokens == alone(lm, p), f"{what}: row {i} (prompt of {len(p)} tokens)"


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("layout", ["pad", "split"])
def test_draft_models_of_every_quality_side_by_side(tiny, self_drafts, random_draft, rule, layout):
    """Chains and trees from a perfect draft (the target), a partial one and a random one, and plain rows."""
    drafts = [tiny.lm, self_drafts[tiny.arch], random_draft, None]
    shapes = [TreeParams.chain(4), TreeParams(width=2, budget=8, depth=4, expand_per_forward=2)]
    drafters = [ModelDrafter(drafts[i % 4], shapes[i % 2]) if drafts[i % 4] is not None else None
                for i in range(len(PROMPTS))]
    engine, results = run_batch(tiny.lm, drafters, RULES[rule](), layout)
    check(tiny.lm, PROMPTS, results, f"{rule}, {layout}")
    if rule != "cost-pause":  # (which may pause every row's drafting for good: low draft probabilities)
        assert engine.stats.accepted > 0  # the perfect draft's rows really accepted drafts


@pytest.mark.parametrize("rule", list(RULES))
def test_ngram_rows(tiny, rule):
    """n-gram chains (of 8 and of 6, cut by the step's rule, which learns their evidence) and the staged
    paper's proposal tree."""
    corpus = [[_rnd.randrange(257) for _ in range(300)] for _ in range(2)] + [alone(tiny.lm, p) for p in PROMPTS[:4]]
    trigram = KatzTrigram.train(corpus, vocab_size=257)
    widths = [(1,) * 8, (1,) * 6, STAGED_WIDTHS]
    drafters = [NgramDrafter(trigram, widths=widths[i % 3], max_n=6) for i in range(len(PROMPTS))]
    engine, results = run_batch(tiny.lm, drafters, RULES[rule](), "auto")
    check(tiny.lm, PROMPTS, results, rule)
    assert engine.stats.accepted > 0


@pytest.mark.parametrize("rule", ["proposed", "fixed2", "bass"])
def test_staged_rows(tiny, self_drafts, rule):
    """Staged trees (a draft model speculated by draft2) in a batch, verified as the rule cuts them. (Not
    under CostAwareLength: the tiny target's flat probabilities make no staged node pay, so it would verify
    nothing; `staged:cost=1` cuts its trees by tree_length, tested with the methods.)"""
    drafters = [StagedDrafter(d, RandomProposals(5 + i, tiny.lm if i % 2 else None),
                              TreeParams(width=3, budget=12, depth=5), widths=(3, 2, 1, 1))
                for i, d in enumerate([tiny.lm, self_drafts[tiny.arch]] * 3)]
    engine, results = run_batch(tiny.lm, drafters, RULES[rule](), "auto", prompts=PROMPTS[:6])
    check(tiny.lm, PROMPTS[:6], results, rule)
    assert engine.stats.accepted > 0  # the perfect draft's staged trees really accepted drafts


def test_magicdec_window_rows(tiny_llama):
    small = resolve_draft(tiny_llama.lm, DraftSources(draft="magicdec:6"), "cpu")
    drafters = [ModelDrafter(small.lm, TreeParams.chain(3), window=small.window) for _ in PROMPTS]
    _, results = run_batch(tiny_llama.lm, drafters, BassLength(3, 8), "split")
    check(tiny_llama.lm, PROMPTS, results, "magicdec")
    assert min(d.cache.lengths[0] for d in drafters[:2]) < len(PROMPTS[1])  # the windows really evicted


@pytest.mark.parametrize("rule", ["proposed", "bass", "cost"])
def test_spire_rows_read_the_target_activations_of_their_own_row(tiny_llama, spire_drafts, rule):
    """SPIRe drafts take their memories from the batch's target forward (prompt chunks, then each root and
    accepted path): the perfect one ("spire-exact") has every chain accepted in full, which fails on any
    row's activations read from another row or position."""
    kinds = ["spire-exact", "spire", "spire-int8", None]
    drafters = [ModelDrafter(spire_drafts[kinds[i % 4]], TreeParams.chain(3)) if kinds[i % 4] else None
                for i in range(len(PROMPTS))]
    _, results = run_batch(tiny_llama.lm, drafters, RULES[rule](), "auto")
    check(tiny_llama.lm, PROMPTS, results, rule)
    for i in (0, 4):  # the exact draft's rows: every verified chain accepted whole
        steps = results[i].stats.steps
        assert steps and all(s.accepted == s.tree_size for s in steps), f"row {i}"


def test_a_drafter_reused_by_the_next_request_starts_afresh(tiny, self_drafts):
    """Rows leave (the last row moves into the freed slot) and queued requests join; a drafter that served
    a finished request serves the next one, reset with the new prompt."""
    drafter = ModelDrafter(self_drafts[tiny.arch], TreeParams.chain(3))
    gens = [GenerationConfig(max_new_tokens=n, stop_on_eos=False) for n in (4, 30, 12, 25)]
    engine = BatchEngine(tiny.lm, max_rows=2, max_context=160, step_tokens=24)
    first = engine.add(BatchRequest(PROMPTS[1], gens[0], drafter=drafter))
    others = [engine.add(BatchRequest(p, g, drafter=ModelDrafter(self_drafts[tiny.arch], TreeParams.chain(2))))
              for p, g in zip(PROMPTS[2:4], gens[1:3], strict=True)]
    while engine.pop_result(first) is None and engine.busy:
        engine.step()
    again = engine.add(BatchRequest(PROMPTS[5], gens[3], drafter=drafter))  # the same drafter, a new prompt
    while engine.busy:
        engine.step()
    for h, p, g in zip([*others, again], [PROMPTS[2], PROMPTS[3], PROMPTS[5]], gens[1:], strict=True):
        assert engine.pop_result(h).tokens == alone(tiny.lm, p, g)


def test_cost_rule_turns_speculation_off_when_drafts_do_not_pay(tiny, random_draft, monkeypatch):
    """With every extra token costing as much as a row, a random draft's tokens never pay: after a few
    steps the rule keeps no node, and with pause the drafters stop drafting (limit 0) except to probe."""
    forwards = []  # the draft model's forwards: the drafters' work
    forward = random_draft.model.forward
    monkeypatch.setattr(random_draft.model, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    rule = CostAwareLength(lambda rows, tokens: float(tokens), pause=True)
    drafters = [ModelDrafter(random_draft, TreeParams.chain(3)) for _ in PROMPTS[:4]]
    engine, results = run_batch(tiny.lm, drafters, rule, "auto", prompts=PROMPTS[:4])
    check(tiny.lm, PROMPTS[:4], results, "cost off")
    assert sum(s.drafted for s in list(engine.stats.recent)[-10:]) == 0
    # no draft token is verified, so each row step emits one token: a row's steps are its tokens. Drafting
    # every step, a chain of 3 costs 3 draft forwards a row step (240 here); paused, a drafter runs only in
    # the first quiet steps, to probe and to catch up on the tokens it skipped: fewer than one a step
    assert len(forwards) < sum(len(r.tokens) for r in results)


# ---- chains: one draft forward per draft step for every row (a TreeGroup of ChainDrafters) ---------
def cheap_nodes(rows: int, tokens: int) -> float:
    """A forward whose draft tokens cost a hundredth of a row: the cost rule keeps (and sizes) chains."""
    return rows + 0.01 * (tokens - rows)


@pytest.mark.parametrize("rule", ["proposed", "bass", "cost", "cost-pause", "cost-cheap"])
@pytest.mark.parametrize("layout", ["pad", "split"])
def test_chain_group_rows_of_every_quality(tiny, self_drafts, random_draft, rule, layout):
    """Three groups (a perfect, a partial and a random draft), their members side by side with plain rows;
    rows join as others leave, and a member serves the next request once its row is done."""
    groups = [chain_members(d, 4) for d in (tiny.lm, self_drafts[tiny.arch], random_draft)]
    drafters = [groups[i % 4]() if i % 4 < 3 else None for i in range(len(PROMPTS))]
    length = CostAwareLength(cheap_nodes) if rule == "cost-cheap" else RULES[rule]()
    engine, results = run_batch(tiny.lm, drafters, length, layout, max_rows=3)
    check(tiny.lm, PROMPTS, results, f"{rule}, {layout}")
    # under `cost` a chain of these tiny drafts' low probabilities may never pay: a greedy chain stops where
    # the rule would cut it, so it may draft nothing at all (as a tree does); `cost-cheap` makes them pay
    if rule not in ("cost", "cost-pause"):
        assert engine.stats.accepted > 0
    if rule == "proposed":  # the perfect draft's rows accept every chain whole
        for i in (0, 4):
            assert all(s.accepted == s.tree_size == 4 for s in results[i].stats.steps[:-1]), f"row {i}"


def test_chain_group_alone_is_a_drafter(tiny, self_drafts):
    """One member (one sequence): the single-sequence engine's chains, lossless, reset for each prompt."""
    member = ChainDrafter(self_drafts[tiny.arch], 3)
    for prompt in PROMPTS[:5]:
        assert generate(tiny.lm, prompt, GEN, drafter=member).tokens == alone(tiny.lm, prompt)


@pytest.mark.parametrize("draft", ["spire-exact", "spire", "spire-int8"])
def test_chain_group_with_spire_drafts_reads_each_rows_activations(tiny_llama, spire_drafts, draft):
    """A SPIRe group writes every row's memories from the target's activations in one write per round; the
    perfect draft accepts every chain whole, which fails on any row's memories from another row."""
    member = chain_members(spire_drafts[draft], 3)
    drafters = [member() if i % 3 else None for i in range(len(PROMPTS))]
    _, results = run_batch(tiny_llama.lm, drafters, AsProposed(), "auto", max_rows=4)
    check(tiny_llama.lm, PROMPTS, results, draft)
    if draft == "spire-exact":
        for i, out in enumerate(results):
            if i % 3:
                assert all(s.accepted == s.tree_size for s in out.stats.steps), f"row {i}"


def test_chain_group_with_magicdec_windows(tiny_llama):
    small = resolve_draft(tiny_llama.lm, DraftSources(draft="magicdec:6"), "cpu")
    group = TreeGroup(small.lm, small.window)
    drafters = [ChainDrafter(small.lm, 3, group=group) for _ in PROMPTS]
    _, results = run_batch(tiny_llama.lm, drafters, BassLength(3, 8), "split")
    check(tiny_llama.lm, PROMPTS, results, "magicdec group")
    assert min(group.cache.lengths) < len(PROMPTS[1])  # the window really evicted


def test_chain_group_up_to_the_context_limit(tiny):
    """Rows whose context ends within a chain's reach: drafts stop at the model's last position."""
    max_len = tiny.lm.config.max_seq_len
    rnd = random.Random(5)
    prompts = [[rnd.randrange(3, 257) for _ in range(n)] for n in (max_len - 12, max_len - 3, max_len - 1, 40)]
    member = chain_members(tiny.lm, 6)  # a perfect draft: every chain runs to its end
    engine = BatchEngine(tiny.lm, max_rows=4, max_context=max_len, step_tokens=128)
    results = engine.run([BatchRequest(p, GEN, drafter=member()) for p in prompts])
    for p, out in zip(prompts, results, strict=True):
        assert out.tokens == alone(tiny.lm, p)


@pytest.fixture(scope="module")
def plain_spire(tiny_models):
    """A SPIRe draft that runs every token itself (no target activations) with feedback memories and a
    window: its long pending prompts take the group's packed prefill."""
    from specstack.config import WindowSpec
    from specstack.models.base import LoadedModel
    from specstack.training.prune import build_draft

    target = tiny_models["llama"].lm
    draft = build_draft(target.model, n_layers=1, keep=[2], window=WindowSpec(1, 12), target_acts=False)
    draft.eval().requires_grad_(False)
    return LoadedModel("plain-spire", draft, None, draft.config, "fp32")


@pytest.mark.parametrize("draft", ["spire", "plain-spire", "self1"])
def test_chain_group_drafts_what_a_lone_drafter_drafts(tiny_llama, spire_drafts, self_drafts, plain_spire, draft):
    """In a batch, a group member proposes the chains a lone ModelDrafter of the same draft proposes for that
    prompt: every step accepts the same number of tokens (a row reading another row's slots, features
    or memories, or a wrong position, would change them)."""
    lm = {"spire": spire_drafts["spire"], "plain-spire": plain_spire, "self1": self_drafts["llama"]}[draft]
    member = chain_members(lm, 3)
    drafters = [member() for _ in PROMPTS]
    _, results = run_batch(tiny_llama.lm, drafters, AsProposed(), "auto", max_rows=4)
    for p, out in zip(PROMPTS, results, strict=True):
        lone = generate(tiny_llama.lm, p, GEN, drafter=ModelDrafter(lm, TreeParams.chain(3)))
        assert out.tokens == lone.tokens
        assert [s.accepted for s in out.stats.steps] == [s.accepted for s in lone.stats.steps], f"prompt of {len(p)}"


@pytest.mark.parametrize("draft", ["self1", "spire", "magicdec"])
def test_draft_caches_grow_with_their_rows(tiny_llama, spire_drafts, self_drafts, draft, monkeypatch):
    """A draft's cache starts at a slot a row and grows as its rows read (never to the draft's whole
    context per row): the rows' outputs and every step's accepted count equal those of caches that
    start large enough never to grow."""
    from specstack import cache as cache_module

    def run(first_slots: int):
        monkeypatch.setattr(cache_module, "FIRST_SLOTS", first_slots)
        if draft == "magicdec":
            small = resolve_draft(tiny_llama.lm, DraftSources(draft="magicdec:6"), "cpu")
            lm, window = small.lm, small.window
        else:
            lm, window = {"self1": self_drafts["llama"], "spire": spire_drafts["spire"]}[draft], None
        group = TreeGroup(lm, window)
        drafters = [ChainDrafter(lm, 3, group=group) for _ in PROMPTS]
        start = group.cache.capacity
        _, results = run_batch(tiny_llama.lm, drafters, AsProposed(), "auto", max_rows=4)
        return group, results, start

    grown, results, _ = run(1)
    whole, reference, start = run(4096)
    assert whole.cache.capacity == start  # the reference never grew
    check(tiny_llama.lm, PROMPTS, results, draft)
    for r, ref in zip(results, reference, strict=True):
        assert [s.accepted for s in r.stats.steps] == [s.accepted for s in ref.stats.steps]
    longest = max(len(p) for p in PROMPTS) + GEN.max_new_tokens
    assert grown.cache.capacity < min(2 * longest, grown.cache.max_capacity)


@pytest.mark.parametrize("draft", ["spire-exact", "self"])
def test_lent_drafters_that_read_activations_hold_their_rows_root(tiny_llama, spire_drafts, draft):
    """Rows lent drafters by the engine's pool, more requests than rows (the plan sizes the queued ones
    before they are lent one): a SPIRe row reads all of its prompt but the root, and its drafter's trees
    give every token (the perfect draft accepts each chain whole, so its activations were the whole
    prompt's); a row whose drafter reads none reads its root with its prompt, whose forward gives the
    first token, as `ar`'s does."""
    lm = spire_drafts["spire-exact"] if draft == "spire-exact" else tiny_llama.lm
    engine = BatchEngine(tiny_llama.lm, max_rows=3, max_context=160, step_tokens=48, drafters=chain_members(lm, 3))
    results = engine.run([BatchRequest(p, GEN) for p in PROMPTS])
    check(tiny_llama.lm, PROMPTS, results, draft)
    for p, out in zip(PROMPTS, results, strict=True):
        drafted = GEN.max_new_tokens - (draft == "self" and len(p) > 1)
        assert sum(s.emitted for s in out.stats.steps) == drafted, f"prompt of {len(p)} tokens"
        assert all(s.accepted == s.tree_size for s in out.stats.steps)
