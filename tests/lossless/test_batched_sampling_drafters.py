"""Sampling losslessness for speculation in a batch (BASS; engine/batched.py): rows that draft chains and
trees verified by recursive rejection sampling (a draft model's q), and staged trees verified by
sample-walk, at two sampling settings, all interleaved in the same batches under a draft-length rule
that changes each step's sizes from what the rows accepted (BASS's shared length, the cost-aware
choice), emit pairs distributed as their own warp's exact law: a row samples x1 with its prompt's last
chunk (as `ar` does) and drafts from x2 on, so the pair is (x2, x3), whose law sums p(x1) p(x2 | x1)
p(x3 | x1, x2) over x1 (test_sampling_equivalence.exact_pairs).

V = 8 tiny target and draft (lossless/conftest.py); chi-square with pooled cells; the thresholds of a test
add up to a false-failure probability of 1e-4 for its fixed seeds."""
from __future__ import annotations

import numpy as np
import pytest
from chisq import chi2_pvalue
from lossless.test_sampling_equivalence import PROMPT, NextTwo, V, exact_pairs

from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.batch_length import BassLength, CostAwareLength
from specstack.drafting.batched_tree import TreeGroup
from specstack.drafting.model import ChainDrafter, ModelDrafter, TreeParams
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import BatchEngine, BatchRequest

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3)]
KINDS = {
    "chain": lambda draft: ModelDrafter(draft, TreeParams.chain(3)),
    "tree": lambda draft: ModelDrafter(draft, TreeParams(width=2, budget=4, depth=2, expand_per_forward=2)),
    "staged": lambda draft: StagedDrafter(draft, NextTwo(), TreeParams(width=2, budget=6, depth=3), widths=(2, 1)),
}
ROWS = 700  # per (kind, setting)
RULES = {"bass": lambda: BassLength(start=2, cap=4),
         "cost": lambda: CostAwareLength(lambda rows, tokens: rows + 0.01 * (tokens - rows))}  # cheap nodes: it drafts


@pytest.mark.parametrize("rule", list(RULES))
def test_drafting_rows_follow_their_own_sampling_parameters(vocab8, rule):
    target, draft = vocab8
    groups = [(kind, s) for kind in KINDS for s in range(len(SETTINGS))]
    requests, group_of = [], []
    for i in range(ROWS * len(groups)):
        kind, s = groups[i % len(groups)]
        gen = GenerationConfig(max_new_tokens=3, stop_on_eos=False,
                               sampling=SamplingParams(**SETTINGS[s], seed=70_000 + i))
        requests.append(BatchRequest(PROMPT, gen, drafter=KINDS[kind](draft)))
        group_of.append((kind, s))
    engine = BatchEngine(target, max_rows=48, max_context=24, length=RULES[rule]())
    results = engine.run(requests)
    tests = len(groups) * 2
    for kind, s in groups:
        rows = [r for r, g in zip(results, group_of, strict=True) if g == (kind, s)]
        counts = np.zeros((V, V))
        for out in rows:
            counts[out.tokens[1], out.tokens[2]] += 1
        accepted = sum(st.accepted for out in rows for st in out.stats.steps)
        assert accepted > 0.1 * len(rows), f"{kind}: drafts (almost) never accepted, the test would not exercise them"
        expected = exact_pairs(target, SamplingParams(**SETTINGS[s]), after=1)
        p_first = chi2_pvalue(counts.sum(1), expected.sum(1))
        p_pair = chi2_pvalue(counts, expected)
        assert p_first > ALPHA / tests, f"{kind}, {SETTINGS[s]}: first token p = {p_first:.2e}"
        assert p_pair > ALPHA / tests, f"{kind}, {SETTINGS[s]}: pairs p = {p_pair:.2e}"


def check_alternating_settings(target, results) -> None:
    """Rows alternate SETTINGS: each setting's first drafted pair follows the target's exact law (chi-square),
    and its rows accepted drafts."""
    for s, args in enumerate(SETTINGS):
        rows = results[s::2]
        counts = np.zeros((V, V))
        for out in rows:
            counts[out.tokens[1], out.tokens[2]] += 1
        assert sum(st.accepted for out in rows for st in out.stats.steps) > 0.1 * len(rows)
        expected = exact_pairs(target, SamplingParams(**args), after=1)
        assert chi2_pvalue(counts.sum(1), expected.sum(1)) > ALPHA / 4, f"{args}: first token"
        assert chi2_pvalue(counts, expected) > ALPHA / 4, f"{args}: pairs"


@pytest.mark.parametrize("rule", list(RULES))
def test_chain_group_rows_follow_their_own_sampling_parameters(vocab8, rule):
    """The same for chains drafted for all rows in one draft forward per step (ChainDrafters of a TreeGroup): the engine lends
    each request a member of the group (its drafter pool), reused as rows finish and new ones join."""
    target, draft = vocab8
    group = TreeGroup(draft)
    requests = [BatchRequest(PROMPT, GenerationConfig(max_new_tokens=3, stop_on_eos=False, sampling=SamplingParams(
        **SETTINGS[i % 2], seed=90_000 + i))) for i in range(2 * ROWS)]
    engine = BatchEngine(target, max_rows=48, max_context=24, length=RULES[rule](), drafters=lambda: ChainDrafter(draft, 3, group=group))
    results = engine.run(requests)
    assert len(group.members) == 48  # one member a row, lent again and again
    check_alternating_settings(target, results)


GROUPED = {  # a member of `group` drafting with KINDS' shapes
    "tree": lambda draft, group: ModelDrafter(draft, TreeParams(width=2, budget=4, depth=2, expand_per_forward=2),
                                              group=group),
    "staged": lambda draft, group: StagedDrafter(draft, NextTwo(), TreeParams(width=2, budget=6, depth=3), widths=(2, 1),
                                                 group=group),
}


@pytest.mark.parametrize("kind", list(GROUPED))
@pytest.mark.parametrize("rule", list(RULES))
def test_tree_group_rows_follow_their_own_sampling_parameters(vocab8, kind, rule):
    """The same for trees (RRS over the draft's q) and staged trees (sample-walk) drafted for all rows in one
    draft forward per level (TreeGroup), members lent by the engine's pool to request after request."""
    target, draft = vocab8
    group = TreeGroup(draft)
    requests = [BatchRequest(PROMPT, GenerationConfig(max_new_tokens=3, stop_on_eos=False, sampling=SamplingParams(
        **SETTINGS[i % 2], seed=110_000 + i))) for i in range(2 * ROWS)]
    engine = BatchEngine(target, max_rows=48, max_context=24, length=RULES[rule](),
                         drafters=lambda: GROUPED[kind](draft, group))
    results = engine.run(requests)
    assert len(group.members) == 48  # one member a row, lent again and again
    assert engine.stats.draft_forwards < sum(s.drafting for s in engine.stats.recent)  # forwards shared by rows
    check_alternating_settings(target, results)
