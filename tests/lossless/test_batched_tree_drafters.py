"""Trees drafted for a batch's rows in one draft forward per level (drafting/batched_tree.py, TreeGroup):
best-first trees and staged spines of a group's members are lossless row by row (in fp32 every row's
greedy output equals that prompt decoded alone), with ragged prompts, rows joining as others leave and
members lent again; a member drafts the trees a lone drafter of the same draft drafts; and a step of B
drafting rows costs the draft one forward per level (plus the catch-up), not B times that."""
from __future__ import annotations

import pytest
from lossless.test_batched_drafters import GEN, PROMPTS, RULES, alone, check, run_batch
from lossless.test_greedy_equality import RandomProposals

from specstack.drafting.batch_length import BassLength
from specstack.drafting.batched_tree import TreeGroup
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import BatchEngine, BatchRequest, generate
from specstack.engine.methods import DraftSources, resolve_draft

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = TreeParams(width=2, budget=8, depth=4, expand_per_forward=2)
STAGED = TreeParams(width=3, budget=12, depth=5)


def staged(draft, seed: int, oracle=None, group: TreeGroup | None = None) -> StagedDrafter:
    return StagedDrafter(draft, RandomProposals(seed, oracle), STAGED, widths=(3, 2, 1, 1), group=group)


@pytest.mark.parametrize("rule", ["proposed", "bass", "cost"])
@pytest.mark.parametrize("layout", ["pad", "split"])
def test_tree_group_rows_of_every_quality(tiny, self_drafts, random_draft, rule, layout):
    """Three groups (a perfect, a partial and a random draft), their members side by side with plain rows
    in 3 rows: rows join as others leave, and a member serves the next request once its row is done."""
    groups = [TreeGroup(d) for d in (tiny.lm, self_drafts[tiny.arch], random_draft)]
    drafters = [ModelDrafter(groups[i % 4].draft, TREE, group=groups[i % 4]) if i % 4 < 3 else None
                for i in range(len(PROMPTS))]
    engine, results = run_batch(tiny.lm, drafters, RULES[rule](), layout, max_rows=3)
    check(tiny.lm, PROMPTS, results, f"{rule}, {layout}")
    if rule != "cost":  # (the tiny target's flat probabilities make no tree node pay)
        assert engine.stats.accepted > 0


@pytest.mark.parametrize("rule", ["proposed", "fixed2", "bass"])
def test_staged_group_rows(tiny, self_drafts, rule):
    """Staged trees (each member's own draft2) of two groups, a perfect and a partial draft, in 4 rows."""
    groups = [TreeGroup(tiny.lm), TreeGroup(self_drafts[tiny.arch])]
    drafters = [staged(groups[i % 2].draft, 5 + i, tiny.lm if i % 3 else None, groups[i % 2]) for i in range(6)]
    engine, results = run_batch(tiny.lm, drafters, RULES[rule](), "auto", prompts=PROMPTS[:6])
    check(tiny.lm, PROMPTS[:6], results, rule)
    assert engine.stats.accepted > 0


def test_a_member_drafts_what_a_lone_drafter_drafts(tiny_llama, self_drafts):
    """In a batch, each step of a group's member accepts what the same prompt's lone drafter accepts (a row
    reading another row's slots, or a wrong position, would change them): best-first trees and staged."""
    lm = self_drafts["llama"]
    trees, spines = TreeGroup(lm), TreeGroup(lm)
    drafters = [ModelDrafter(lm, TREE, group=trees) if i % 2 else staged(lm, i, None, spines)
                for i in range(len(PROMPTS))]
    engine = BatchEngine(tiny_llama.lm, max_rows=4, max_context=160, step_tokens=128)  # room for every tree
    results = engine.run([BatchRequest(p, GEN, drafter=d) for p, d in zip(PROMPTS, drafters, strict=True)])
    for i, (p, out) in enumerate(zip(PROMPTS, results, strict=True)):
        lone = generate(tiny_llama.lm, p, GEN, drafter=ModelDrafter(lm, TREE) if i % 2 else staged(lm, i))
        assert out.tokens == lone.tokens
        assert [s.accepted for s in out.stats.steps] == [s.accepted for s in lone.stats.steps], f"prompt {i}"


def test_tree_group_alone_is_a_drafter(tiny, self_drafts):
    """One member (one sequence), reset for each prompt."""
    member = ModelDrafter(self_drafts[tiny.arch], TREE, group=TreeGroup(self_drafts[tiny.arch]))
    for prompt in PROMPTS[:5]:
        assert generate(tiny.lm, prompt, GEN, drafter=member).tokens == alone(tiny.lm, prompt)


@pytest.mark.parametrize("draft", ["spire-exact", "spire", "magicdec"])
def test_tree_group_with_spire_and_magicdec_drafts(tiny_llama, spire_drafts, draft):
    """A SPIRe group writes every row's memories from the target's activations, a MagicDec group keeps a
    window per row; every tree of the perfect SPIRe draft has its first node (the draft's argmax) accepted
    on every row."""
    if draft == "magicdec":
        small = resolve_draft(tiny_llama.lm, DraftSources(draft="magicdec:6"), "cpu")
        group, lm = TreeGroup(small.lm, small.window), small.lm
    else:
        group = TreeGroup(spire_drafts[draft])
        lm = group.draft
    drafters = [ModelDrafter(lm, TREE, group=group) if i % 3 else None for i in range(len(PROMPTS))]
    _, results = run_batch(tiny_llama.lm, drafters, BassLength(3, 8), "auto", max_rows=4)
    check(tiny_llama.lm, PROMPTS, results, draft)
    if draft == "spire-exact":
        for i, out in enumerate(results):
            if i % 3:
                assert all(s.accepted >= 1 for s in out.stats.steps if s.tree_size), f"row {i}"


def test_tree_group_up_to_the_context_limit(tiny):
    """Rows whose context ends within a tree's reach: nodes stop at the model's last position."""
    import random

    max_len = tiny.lm.config.max_seq_len
    rnd = random.Random(5)
    prompts = [[rnd.randrange(3, 257) for _ in range(n)] for n in (max_len - 12, max_len - 3, max_len - 1, 40)]
    group = TreeGroup(tiny.lm)  # a perfect draft: every tree is accepted to its depth
    engine = BatchEngine(tiny.lm, max_rows=4, max_context=max_len, step_tokens=128)
    results = engine.run([BatchRequest(p, GEN, drafter=ModelDrafter(tiny.lm, TREE, group=group)) for p in prompts])
    for p, out in zip(prompts, results, strict=True):
        assert out.tokens == alone(tiny.lm, p)
