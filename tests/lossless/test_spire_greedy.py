"""Greedy losslessness with SPIRe drafts (specstack.models.spire_draft): drafts that read the target's activations
for verified tokens, keep a sliding window, mix feedback memories and draft from a reduced vocabulary
emit exactly the target's greedy tokens, for chains, trees and the staged drafter, up to the context
limit. A perfect SPIRe draft (all target blocks, one-hot memories) has every chain accepted in full,
which fails on any misplaced target activation (wrong rows, positions or tokens)."""
from __future__ import annotations

import random

import pytest
import torch
from lossless.conftest import spire_lm
from lossless.test_greedy_equality import (
    GEN,
    PROMPTS,
    SHAPES,
    RandomProposals,
    ar_tokens,
    one_row_rule,
)

from specstack.config import WindowSpec
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, resolve_draft
from specstack.training.distill import ChainCounts
from specstack.training.teacher import OnlineTeacher, TeacherSpec, hidden_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("draft", ["spire", "spire-int8", "spire-exact"])
def test_spire_greedy_equals_autoregressive(tiny_llama, spire_drafts, shape, draft):
    params = SHAPES[shape]
    drafter = ModelDrafter(spire_drafts[draft], params)
    s = list(SHAPES).index(shape)
    for i in range(2 * s, 2 * s + 3):
        prompt = PROMPTS[i % len(PROMPTS)]
        out = generate(tiny_llama.lm, prompt, GEN, drafter=drafter)
        assert out.tokens == ar_tokens(tiny_llama, prompt), f"prompt {i % len(PROMPTS)}"
        steps = out.stats.steps
        if draft == "spire-exact" and params.width == 1:
            assert [st.accepted for st in steps] == [params.depth] * len(steps)
        elif draft == "spire-exact":
            assert all(st.accepted >= 1 for st in steps)


@pytest.mark.parametrize("draft", ["spire", "spire-int8", "spire-exact"])
@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("sized", [False, True])
def test_spire_staged_greedy_equals_autoregressive(tiny_llama, spire_drafts, draft, oracle, sized):
    """sized: trees cut each step by the cost-aware budget (a cost wall after 4 nodes), which also
    stops the spine once it leaves the nodes worth verifying."""
    source = RandomProposals(5, tiny_llama.lm if oracle else None)
    curve = [1.0, 1.1, 1.2, 1.3, 1.4] + [100.0] * 16
    drafter = StagedDrafter(spire_drafts[draft], source, TreeParams(width=3, budget=20, depth=6), widths=(4, 3, 2, 1, 1))
    for prompt in PROMPTS[2:6]:
        out = generate(tiny_llama.lm, prompt, GEN, drafter=drafter, length=one_row_rule(curve) if sized else None)
        assert out.tokens == ar_tokens(tiny_llama, prompt)
        if sized:  # the wall after 4 nodes holds (unsized staged trees reach 20)
            assert max(st.tree_size for st in out.stats.steps) <= 4


@pytest.mark.parametrize("shape", ["chain8", "tree4-36-8-4"])
def test_spire_up_to_the_context_limit(tiny_llama, spire_drafts, shape):
    max_len = tiny_llama.lm.config.max_seq_len
    rnd = random.Random(7)
    drafter = ModelDrafter(spire_drafts["spire"], SHAPES[shape])
    for n_prompt in (max_len - 30, max_len - 3, max_len - 1):
        prompt = [rnd.randrange(257) for _ in range(n_prompt)]
        out = generate(tiny_llama.lm, prompt, GEN, drafter=drafter)
        assert out.tokens == ar_tokens(tiny_llama, prompt)


@pytest.mark.parametrize("shape", ["chain4", "tree3-20-4-2"])
def test_magicdec_window_draft_greedy_equals_autoregressive(tiny_llama, shape):
    """MagicDec (`--draft magicdec:W`): the target drafting for itself through a sliding-window cache
    that evicts; the output stays the target's, and a window covering the context is a perfect draft."""
    small = resolve_draft(tiny_llama.lm, DraftSources(draft="magicdec:6"), "cpu")
    assert small.lm is tiny_llama.lm and small.window == WindowSpec(1, 6)
    drafter = ModelDrafter(small.lm, SHAPES[shape], window=small.window)
    for prompt in PROMPTS[4:8]:
        out = generate(tiny_llama.lm, prompt, GEN, drafter=drafter)
        assert out.tokens == ar_tokens(tiny_llama, prompt)
    assert drafter.cache.lengths[0] < len(PROMPTS[7])  # the draft's cache really evicted
    whole = ModelDrafter(tiny_llama.lm, SHAPES["chain4"], window=WindowSpec(1, 1000))
    out = generate(tiny_llama.lm, PROMPTS[5], GEN, drafter=whole)
    assert [st.accepted for st in out.stats.steps] == [4] * len(out.stats.steps)


NOISE = 0.3  # the last block's weights moved by 0.3 of their spread


def test_the_walked_count_is_what_the_engine_does(tiny_llama):
    """The held-out measure's walk (distill.ChainCounts) on the target's own greedy text replays the
    engine round for round: the same draft, teacher-forced with the target's activations, accepts the
    same number of tokens in each round as the engine's chain did (fp32: no near-ties to break)."""
    target = tiny_llama.lm
    draft = spire_lm(target, [0, 1, 2], mix="own")  # the target itself (always accepted) ...
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ... with its last block disturbed: accepted often, not always
        for prm in draft.model.layers[2].parameters():
            prm.add_(NOISE * prm.std() * torch.randn(prm.shape, generator=g))
    k, seen = 3, []
    for prompt in PROMPTS[3:8]:
        out = generate(target, prompt, GEN, drafter=ModelDrafter(draft, TreeParams.chain(k)))
        engine = [st.accepted for st in out.stats.steps]
        text = torch.tensor([list(prompt) + out.tokens], dtype=torch.int32)
        spec = TeacherSpec(layers=draft.model.spire.target_layers)
        batch = next(OnlineTeacher(target.model, text[:0], text, spec).heldout_batches())
        guesses = draft.model.train_forward(batch["tokens"].long(), hidden_for(batch, spec.layers), k)
        start = len(prompt) - 1  # the first round's query is the prompt's last token
        counts = ChainCounts(k)
        counts.add(batch["tokens"][0, start:].long(), batch["topk_ids"][0, start:, 0].long(),
                   [draft.model.vocab_ids[g[0].argmax(-1)][start:] for g in guesses])
        n = len(counts.rounds) - 1  # the engine's last rounds are cut short by max_new_tokens
        assert counts.rounds[:n] == engine[:n], f"prompt of {len(prompt)} tokens"
        seen += engine[:n]
    assert 0 < sum(seen) < k * len(seen) and len(set(seen)) > 2  # a test of real, partial acceptance
