"""The draft-length rules in a batch (drafting/batch_length.py) and the cost-aware choice
(draft_length.best_prefixes) worked by hand; one row's cases are tests/unit/test_draft_length.py."""
from __future__ import annotations

import pytest
import torch

from specstack.drafting.batch_length import BACKOFF, AsProposed, BassLength, CostAwareLength, FixedLength, StepShape
from specstack.drafting.draft_length import best_prefixes
from specstack.tree import DraftTree


def chain(n: int, confidence: list[float] | None = None) -> DraftTree:
    tree = DraftTree.chain(list(range(10, 10 + n)))
    if confidence is not None:
        tree.confidence = list(confidence)
    return tree


# ---- best_prefixes ---------------------------------------------------------------------------------
def test_one_row_is_the_best_prefix_by_rate():
    costs = [1.0, 1.1, 1.2, 1.3, 2.0]
    for gains in ([0.9, 0.8, 0.7, 0.6], [0.05, 0.01], [0.9, 0.85, 0.8, 0.75], []):
        rates = [(1 + sum(gains[:n])) / costs[n] for n in range(len(gains) + 1)]
        assert best_prefixes([gains], lambda e: costs[e], 1.0) == [rates.index(max(rates))]
    assert best_prefixes([[0.9, 0.8, 0.7, 0.6]], lambda e: costs[e], 1.0) == [3]  # the fourth crosses the jump


def test_the_batch_takes_the_surest_nodes_of_any_row():
    # two rows; a forward costs 2 (two rows) + 0.25 a draft node: a node pays while its gain is above
    # 0.25 * (tokens so far) / (cost so far); row 0 is sure (0.9, 0.8), row 1 unsure (0.3, 0.1)
    cost = lambda extra: 2.0 + 0.25 * extra  # noqa: E731
    # rates: none 2/2 = 1; +0.9 -> 2.9/2.25 = 1.289; +0.8 -> 3.7/2.5 = 1.48; +0.3 -> 4.0/2.75 = 1.4545
    assert best_prefixes([[0.9, 0.8], [0.3, 0.1]], cost, 2.0) == [2, 0]
    # costlier nodes: only the surest pays (2.9/2.9 = 1.0 is a tie with none: ties keep fewer)
    assert best_prefixes([[0.9, 0.8], [0.3, 0.1]], lambda e: 2.0 + 0.9 * e, 2.0) == [0, 0]
    assert best_prefixes([[0.95, 0.8], [0.3, 0.1]], lambda e: 2.0 + 0.9 * e, 2.0) == [1, 0]


def test_a_row_is_cut_to_a_prefix_even_when_a_later_node_looks_better():
    # row 0's second node has a larger gain than its first (tree order): it cannot come before it
    out = best_prefixes([[0.1, 0.95]], lambda e: 1.0 + 0.05 * e, 1.0)
    assert out == [2]  # 2.05/1.1 beats 1.1/1.05 and 1/1


# ---- the rules -------------------------------------------------------------------------------------
def test_as_proposed_and_fixed():
    trees = [chain(5), chain(0), chain(2)]
    assert AsProposed().limit() is None and AsProposed().choose(trees, 3, 3) == [5, 0, 2]
    assert FixedLength(3).limit() == 3 and FixedLength(3).choose(trees, 3, 3) == [3, 0, 2]


def test_bass_shares_one_length_across_the_batch():
    rule = BassLength(start=7, cap=12)
    assert rule.limit() == 7
    assert rule.choose([chain(9), chain(3)], 2, 2) == [7, 3]
    rule.observe([chain(7), chain(3)], [7, 1])  # a row accepted all 7: l + 2
    assert rule.limit() == 9
    rule.observe([chain(9), chain(9)], [2, 4])  # none did: 9 - ceil(0.9) - 0 = 8, never below 4
    assert rule.limit() == 8
    rule.observe([chain(8)], [1])  # a second miss shrinks one more: 8 - 1 - 1
    assert rule.limit() == 6
    rule.observe([], [])  # a step without drafts changes nothing
    assert rule.limit() == 6


def test_cost_rule_uses_confidences_and_calibrates_them():
    cost = lambda rows, tokens: rows + 0.5 * (tokens - rows)  # noqa: E731
    rule = CostAwareLength(cost)
    sure, unsure = chain(3, [0.95, 0.9, 0.2]), chain(3, [0.3, 0.1, 0.05])
    # rates: 2/2; +0.95: 2.95/2.5 = 1.18; +0.9: 3.85/3 = 1.283; +0.3: 4.15/3.5 = 1.186
    assert rule.choose([sure, unsure], 2, 2) == [2, 0]
    # the drafter was overconfident: 5 accepted of 20 predicted, so c = (1 + 5) / (1 + 20) = 0.286 (a
    # pseudo-step each) and 0.95 -> 0.27 no longer pays at 0.5 a node
    for _ in range(5):
        rule.observe([chain(4, [1.0, 1.0, 1.0, 1.0])], [1])
    assert rule.choose([sure, unsure], 2, 2) == [0, 0]


def test_cost_rule_learns_depth_rates_for_trees_without_confidences():
    rule = CostAwareLength(lambda rows, tokens: rows + 0.3 * (tokens - rows))
    assert rule.rates.p(1) == 0.5  # the Beta(1, 1) prior
    for _ in range(20):  # the first node always accepted, the second never
        rule.observe([chain(3)], [1])
    assert rule.rates.p(1) == pytest.approx(21 / 22) and rule.rates.p(2) == pytest.approx(1 / 22)
    assert rule.rates.p(3) == 0.5  # never tried: depth 2 always failed first
    assert rule.choose([chain(3)], 1, 1) == [1]


def test_sampled_trees_are_cut_only_by_what_was_known_before_the_draw():
    q = torch.full((4,), 0.25)
    rule = CostAwareLength(lambda rows, tokens: float(tokens))  # every node costs a row: none pays
    branching = DraftTree([1, 2, 3], [-1, -1, 0], q=[q, q, q], confidence=[0.9, 0.9, 0.9])
    sampled_chain = DraftTree.chain([1, 2, 3])
    sampled_chain.q = [q, q, q]
    sampled_chain.confidence = [1.0, 1.0, 1.0]  # ignored: its tokens were drawn from q
    sampled_chain.evidence = ["sure"] * 3  # ignored too: which class a drawn token falls in depends on the draw
    for _ in range(50):
        rule.rates.trial("sure", True)
    assert rule.gains(branching) is None and rule.choose([branching], 1, 1) == [3]  # verified whole
    assert rule.gains(sampled_chain) == pytest.approx([0.5, 0.25, 0.125])  # learned rates, not confidences
    assert rule.choose([sampled_chain], 1, 1) == [0]


def test_cost_rule_pauses_drafting_then_probes_ever_less_often():
    rule = CostAwareLength(lambda rows, tokens: rows + 0.5 * (tokens - rows), pause=True, quiet=2, probe=3)

    def steps(n: int) -> list[int | None]:
        limits = []
        for _ in range(n):
            limits.append(rule.limit())
            rule.choose([chain(2, [0.1, 0.05]) if limits[-1] is None else chain(0)], 1, 1)
        return limits

    # two idle steps, then probes 3, 6 and 12 steps apart (the next 24 later): each that finds nothing
    # doubles the wait
    probes = [i for i, limit in enumerate(steps(40)) if limit is None]
    assert probes == [0, 1, 2, 5, 11, 23]
    assert rule.limit() == 0
    rule.choose([chain(2, [1.0, 1.0])], 1, 1)  # a sure draft pays: drafting resumes
    assert rule.limit() is None
    rule.choose([chain(2, [1.0, 1.0])], 1, 1)
    # and a pause that follows waits the first gap again, up to BACKOFF x probe at most
    assert [i for i, limit in enumerate(steps(200)) if limit is None][:5] == [0, 1, 2, 5, 11]
    assert rule._gap == BACKOFF * 3


@pytest.mark.parametrize("drafting,expect", [(3.0, [None, None, None, 0, 0, None]), (0.1, [None] * 6)])
def test_drafts_that_do_not_pay_for_their_drafting_pause_it(drafting, expect):
    """Each step's nodes are chosen with its drafting as spent (0.9-sure nodes are kept however long it
    took), but whether the step paid counts that drafting: 2.71 expected tokens in 3 s of drafting and a
    2 s forward are fewer a second than one token in the 1 s step without drafts, so such steps are idle and
    drafting pauses; in 0.1 s of drafting they pay (2.71 in 2.1 s) and it never does."""
    now = [0.0]
    rule = CostAwareLength(lambda rows, tokens: rows + 0.5 * (tokens - rows), pause=True, quiet=2, probe=3,
                           clock=lambda: now[0])
    limits = []
    for _ in range(6):
        limits.append(rule.limit())
        if limits[-1] is None:
            now[0] += drafting  # the draft forwards of this step
        tree = chain(2, [0.9, 0.81]) if limits[-1] is None else chain(0)
        assert rule.choose([tree], 1, 1) == [len(tree)]  # what is drafted is kept: each node pays on its own
    assert limits == expect


def test_a_trial_rule_lets_one_row_draft_until_drafting_pays():
    """trial_rows=1: one row drafts at first and after every step whose drafting did not pay, every row
    the step after one of decoding rows only that paid (a step that also reads a prompt chunk, 40 tokens,
    does not end a trial, though its drafts paid); a step with no drafting row changes nothing; without
    trial_rows every row always may."""
    rule = CostAwareLength(lambda rows, tokens: rows + 0.5 * (tokens - rows), pause=True, quiet=5, trial_rows=1)
    sure, unsure = chain(2, [1.0, 1.0]), chain(2, [0.1, 0.05])
    seen = []
    for tree, tokens in [(unsure, 3), (sure, 40), (sure, 3), (None, 3), (sure, 40), (unsure, 3)]:
        rule.limit()
        seen.append(rule.trial())
        rule.choose([] if tree is None else [tree, chain(0), chain(0)], 3, tokens)
    rule.limit()
    assert seen + [rule.trial()] == [1, 1, 1, None, None, None, 1]
    assert CostAwareLength(lambda rows, tokens: rows, pause=True).trial() is None


def test_a_rule_pausing_from_two_rows_lets_a_lone_row_keep_proposing():
    """A server's n-gram rule (pause=2): idle steps of one row never pause its drafting; the same idle
    steps of two rows do, until a probe."""
    for rows, expect in [(1, [None] * 6), (2, [None, None, None, 0, 0, None])]:
        rule = CostAwareLength(lambda r, tokens: r + 0.5 * (tokens - r), pause=2, quiet=2, probe=3)
        limits = []
        for _ in range(6):
            limits.append(rule.limit())
            rule.choose([chain(2, [0.1, 0.05]) if limits[-1] is None else chain(0)] * rows, rows, rows)
        assert limits == expect, rows


def evidence_chain(*classes) -> DraftTree:
    tree = DraftTree.chain(list(range(10, 10 + len(classes))))
    tree.evidence = list(classes)
    return tree


def test_cost_rule_sizes_rows_by_what_their_evidence_has_earned():
    rule = CostAwareLength(lambda rows, tokens: rows + 0.3 * (tokens - rows))
    for _ in range(30):  # context matches are right, trigram guesses wrong
        rule.observe([evidence_chain("match", "match"), evidence_chain("guess")], [2, 0])
    assert rule.rates.p("match") == pytest.approx(61 / 62) and rule.rates.p("guess") == pytest.approx(1 / 32)
    keep = rule.choose([evidence_chain("match", "match", "guess"), evidence_chain("guess", "match")], 2, 2)
    assert keep == [2, 0]  # a guess sinks the chain behind it, in any row


def test_forced_tokens_start_near_certain_where_other_unseen_drafts_do_not_pay():
    """A grammar's forced chain (evidence ("grammar", depth)) is verified by a fresh rule on a target
    whose second row costs 0.55 of a step, where an unseen class at even odds is not; once rejections
    are seen, the forced class earns its rate like any other."""
    cost = lambda rows, tokens: rows + 0.55 * (tokens - rows)  # noqa: E731
    rule = CostAwareLength(cost)
    forced = evidence_chain(*[("grammar", d) for d in (1, 2, 3, 4)])
    assert rule.choose([forced], 1, 1) == [3]  # (1 + .9 + .81 + .73) / 2.65 beats every other length
    assert rule.choose([evidence_chain(("ngram", 1), ("ngram", 2))], 1, 1) == [0]  # 1.5 / 1.55 < 1
    for _ in range(20):
        rule.observe([evidence_chain(("grammar", 1))], [0])  # the target tokenizes it otherwise
    assert rule.rates.p(("grammar", 1)) == pytest.approx(9 / 30)
    assert rule.choose([forced], 1, 1) == [0]


def test_what_drafters_learned_of_nodes_cut_unverified_counts_before_the_choice():
    rule = CostAwareLength(lambda rows, tokens: rows + 0.5 * (tokens - rows))
    rule.learn([("m", True)] * 6)  # of a chain cut to nothing: its drafter has since seen the target's tokens
    assert rule.rates.p("m") == pytest.approx(7 / 8)
    assert rule.choose([evidence_chain("m")], 1, 1) == [1]  # 1.875 / 1.5 beats 1 / 1
    assert CostAwareLength(rule.cost).choose([evidence_chain("m")], 1, 1) == [0]  # 1.5 / 1.5: a tie keeps none


def test_in_growth_size_is_the_rule_for_the_step_shape():
    """`size` (ctx.size) answers for a growing tree as `choose` would for it alone in this step: its shape
    as limit() was told it, else a step like the last."""
    rule = CostAwareLength(lambda rows, tokens: rows + 0.5 * (tokens - rows))
    scores = [0.9, 0.8, 0.6]
    assert rule.size(scores) == rule.choose([chain(3, scores)], 1, 1)[0] == 2  # 2.7 / 2 against 2.3 / 1.5
    rule.choose([chain(0)] * 4, 4, 4)  # a step of four rows: a node now costs an eighth of the forward
    assert rule.size(scores) == 3
    # told this step's shape: one drafting row beside a prompt chunk, whose tokens already made the
    # forward as dear as its nodes will (the cost is flat past one token here: nodes are free)
    flat = CostAwareLength(lambda rows, tokens: 1.0 if tokens == 1 else 2.0)
    unsure = [0.4, 0.3, 0.2]
    assert flat.size(unsure) == 0  # as after a one-token step: 1 / 1 beats 1.9 / 2
    flat.limit(StepShape(rows=2, tokens=8, trees=1))
    assert flat.size(unsure) == flat.choose([chain(3, unsure)], 2, 8)[0] == 3  # 1.9 / 2 beats 1 / 2
    flat.limit()  # not told: the last step's shape (two rows, eight tokens)
    assert flat.size(unsure) == 3
    flat.limit(StepShape(rows=1, tokens=1))  # a decode step of the row alone
    assert flat.size(unsure) == 0


def test_the_engine_tells_the_rule_the_step_shape_before_drafting(tiny_llama):
    """limit(shape) gets the rows and tokens that choose then gets, prompt chunks included (a row reading
    its prompt beside a drafting one), so a tree grows by the step it will be verified in."""
    from specstack.config import GenerationConfig
    from specstack.drafting.model import ChainDrafter
    from specstack.engine.batched import BatchEngine, BatchRequest

    class Recorded(AsProposed):
        def __init__(self):
            super().__init__()
            self.shapes, self.choices = [], []

        def limit(self, shape=None):
            self.shapes.append(shape)
            return None

        def choose(self, trees, rows, tokens):
            self.choices.append((len(self.shapes) - 1, StepShape(rows, tokens, max(1, len(trees)))))
            return super().choose(trees, rows, tokens)

    rule = Recorded()
    lm = tiny_llama.lm
    gen = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    engine = BatchEngine(lm, max_rows=2, step_tokens=16, length=rule)
    prompts = [[5, 9, 3], [(7 * i) % 200 + 3 for i in range(40)]]  # the long one reads in chunks
    engine.run([BatchRequest(p, gen, drafter=ChainDrafter(lm, 3)) for p in prompts])
    assert rule.choices and all(rule.shapes[i] == shape for i, shape in rule.choices)
    assert any(shape.tokens > shape.rows for _, shape in rule.choices)  # a step that also read a chunk


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_the_engine_hands_the_rule_to_a_growing_tree(tiny_llama, monkeypatch, kind):
    """ctx.size comes from the step's rule, and the draft stops expanding nodes it would cut (a tree, and a
    chain, the tree of width one)."""
    from specstack.config import GenerationConfig
    from specstack.drafting.model import ChainDrafter, ModelDrafter, TreeParams
    from specstack.engine.batched import generate

    lm = tiny_llama.lm
    forwards = []
    real = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: forwards.append(1) or real(*a, **k))

    class CutToOne(AsProposed):  # keeps one node of each tree, but only once it is grown
        def choose(self, trees, rows, tokens):
            return [min(1, len(t)) for t in trees]

    class SizedToOne(CutToOne):  # the same choice, known while the tree grows
        def size(self, scores):
            return min(1, len(scores))

    gen = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    prompt = [5, 9, 3, 7, 11]
    runs = []
    for rule in (CutToOne(), SizedToOne()):
        forwards.clear()
        drafter = ModelDrafter(lm, TreeParams(4, 12, 4, 2)) if kind == "tree" else ChainDrafter(lm, 4)
        out = generate(lm, prompt, gen, drafter=drafter, length=rule)
        runs.append((out.tokens, [st.tree_size for st in out.stats.steps], len(forwards)))
    (cut_tokens, cut_sizes, cut_forwards), (sized_tokens, sized_sizes, sized_forwards) = runs
    assert sized_tokens == cut_tokens and sized_sizes == cut_sizes and max(sized_sizes) == 1
    assert sized_forwards < cut_forwards  # the same steps, fewer draft forwards
