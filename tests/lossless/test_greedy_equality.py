"""Greedy losslessness (DESIGN §2.1): speculative decoding with a model drafter emits exactly the
target's own greedy tokens, token for token, in fp32, for chains and trees, with drafts that are
perfect (the target itself), partial (the target's first layer, engine.draft_sources.self_draft) and
useless (an unrelated random model); with EOS inside an accepted run; and up to the context limit."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specstack.config import GenerationConfig
from specstack.drafting.batch_length import CostAwareLength
from specstack.drafting.model import ChainDrafter, ModelDrafter, TreeParams
from specstack.engine.batched import generate

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {
    "chain1": TreeParams.chain(1),
    "chain2": TreeParams.chain(2),
    "chain4": TreeParams.chain(4),
    "chain8": TreeParams.chain(8),
    "tree4-36-8-4": TreeParams(width=4, budget=36, depth=8, expand_per_forward=4),
    "tree2-10-5-1": TreeParams(width=2, budget=10, depth=5, expand_per_forward=1),
    "tree3-20-4-2": TreeParams(width=3, budget=20, depth=4, expand_per_forward=2),
}
_rnd = random.Random(2024)
PROMPTS = [[_rnd.randrange(257) for _ in range(n)] for n in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)]
GEN = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
DRAFTS = ("target", "self1", "random")

_ar_cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def one_row_rule(curve: list[float]) -> CostAwareLength:
    """The cost-aware rule of a lone row over its width curve (curve[T - 1]: a forward over T tokens)."""
    return CostAwareLength(lambda rows, tokens: curve[tokens - 1], longest=len(curve) - 1)


def ar_tokens(tiny, prompt: list[int], max_new: int = 30) -> list[int]:
    key = (tiny.arch, tuple(prompt), max_new)
    if key not in _ar_cache:
        gen = GenerationConfig(max_new_tokens=max_new, stop_on_eos=False)
        _ar_cache[key] = generate(tiny.lm, prompt, gen).tokens
    return _ar_cache[key]


@pytest.fixture
def drafts(tiny, self_drafts, random_draft):
    return {"target": tiny.lm, "self1": self_drafts[tiny.arch], "random": random_draft}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_speculative_greedy_equals_autoregressive(tiny, drafts, shape):
    params = SHAPES[shape]
    s = list(SHAPES).index(shape)
    for d, name in enumerate(DRAFTS):
        drafter = ModelDrafter(drafts[name], params)  # one drafter, reset for every prompt
        start = 3 * s + 4 * d  # 3 prompts per draft, rotating so every prompt meets every draft
        for i in range(start, start + 3):
            prompt = PROMPTS[i % len(PROMPTS)]
            out = generate(tiny.lm, prompt, GEN, drafter=drafter)
            assert out.tokens == ar_tokens(tiny, prompt), f"draft {name}, prompt {i % len(PROMPTS)}"
            assert out.finish_reason == "length"
            steps = out.stats.steps
            # a prompt longer than its root gives the first token with its last chunk, as ar's does
            drafted = 30 - (len(prompt) > 1)
            assert sum(st.emitted for st in steps) == drafted
            assert all(len(st.origins) == st.emitted for st in steps)
            if name == "target":
                if params.width == 1:
                    # a perfect draft has every chain accepted in full: tau = k + 1
                    assert [st.accepted for st in steps] == [params.depth] * len(steps)
                    assert len(steps) == -(-drafted // (params.depth + 1))
                else:
                    # its best child of the root is the target's argmax
                    assert all(st.accepted >= 1 for st in steps)


@pytest.mark.parametrize("kind", ["tree", "chain"])
@pytest.mark.parametrize("costs", ["flat", "steep"])
def test_cost_sized_trees_equal_autoregressive(tiny, drafts, costs, kind):
    """Trees (and chains of 8) sized each step by the cost-aware rule, as they grow and once grown (on a
    flat cost curve every node pays: the full 36-node tree, the whole chain; a wall after 3 nodes cuts
    them to 3 or fewer), from every draft: the output is still autoregressive's."""
    curve = [1.0] * 37 if costs == "flat" else [1.0, 1.1, 1.2, 1.3] + [100.0] * 33
    whole = 36 if kind == "tree" else 8
    for d, name in enumerate(DRAFTS):
        drafter = ModelDrafter(drafts[name], SHAPES["tree4-36-8-4"]) if kind == "tree" else ChainDrafter(drafts[name], 8)
        sizes = []
        for i in range(2 * d, 2 * d + 2):
            prompt = PROMPTS[i % len(PROMPTS)]
            out = generate(tiny.lm, prompt, GEN, drafter=drafter, length=one_row_rule(curve))
            assert out.tokens == ar_tokens(tiny, prompt), f"draft {name}, prompt {i % len(PROMPTS)}"
            sizes += [st.tree_size for st in out.stats.steps]
        if costs == "steep":
            assert max(sizes) <= 3 and min(sizes) == 0  # the random draft's trees are not worth a node
        else:
            assert max(sizes) == whole


@pytest.mark.parametrize("shape", ["chain4", "tree4-36-8-4"])
@pytest.mark.parametrize("draft", ["target", "random"])
def test_eos_inside_an_accepted_run(tiny, drafts, shape, draft):
    """EOS (here: a token the target emits mid-way, declared EOS) ends generation at the same token
    as autoregressive decoding, even when it sits inside a run of accepted draft tokens."""
    for prompt in PROMPTS[3:6]:
        ref = ar_tokens(tiny, prompt)
        eos = ref[12]
        cut = ref.index(eos)
        target = replace(tiny.lm, config=replace(tiny.lm.config, eos_token_ids=(eos,)))
        gen = GenerationConfig(max_new_tokens=30, stop_on_eos=True)
        ar = generate(target, prompt, gen)
        assert ar.tokens == ref[:cut] and ar.finish_reason == "eos"
        out = generate(target, prompt, gen, drafter=ModelDrafter(drafts[draft], SHAPES[shape]))
        assert out.tokens == ar.tokens
        assert out.finish_reason == "eos"


@pytest.mark.parametrize("shape", ["chain8", "tree4-36-8-4"])
@pytest.mark.parametrize("draft", ["target", "random"])
def test_generation_up_to_the_context_limit(tiny, drafts, shape, draft):
    """Prompts ending near max_seq_len (256): the tree and the draft must not run past the last
    position; the output is the autoregressive one, cut at the context limit."""
    max_len = tiny.lm.config.max_seq_len
    rnd = random.Random(7)
    drafter = ModelDrafter(drafts[draft], SHAPES[shape])
    for n_prompt in (max_len - 30, max_len - 12, max_len - 3, max_len - 1):
        prompt = [rnd.randrange(257) for _ in range(n_prompt)]
        ref = ar_tokens(tiny, prompt)
        assert len(ref) == min(30, max_len - n_prompt)
        out = generate(tiny.lm, prompt, GEN, drafter=drafter)
        assert out.tokens == ref, f"prompt of {n_prompt} tokens"


class RandomProposals:
    """draft2 stand-in that proposes random tokens in the paper's tree shape, plus the target's own
    continuation on some levels when given one: proposals of any quality must leave the output alone."""

    def __init__(self, seed: int, oracle=None) -> None:
        self.rng = random.Random(seed)
        self.oracle = oracle

    def reset(self, prompt_ids) -> None:
        pass

    def proposal_tree(self, context, widths):
        from specstack.tree import DraftTree

        tree, parent = DraftTree(), -1
        good = generate(self.oracle, list(context), replace(GEN, max_new_tokens=len(widths))).tokens if self.oracle else []
        for d, w in enumerate(widths):
            first = good[d] if d < len(good) and self.rng.random() < 0.7 else self.rng.randrange(257)
            best = tree.add(first, parent, "draft2")
            for _ in range(w - 1):
                tok = self.rng.randrange(257)
                if tok != first:
                    tree.add(tok, parent, "draft2")
            parent = best
        return tree


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("oracle", [False, True])
def test_staged_greedy_equals_autoregressive(tiny, drafts, draft, oracle):
    from specstack.drafting.staged import StagedDrafter

    source = RandomProposals(5, tiny.lm if oracle else None)
    drafter = StagedDrafter(drafts[draft], source, TreeParams(width=3, budget=20, depth=6), widths=(4, 3, 2, 1, 1))
    for prompt in PROMPTS[2:6]:
        out = generate(tiny.lm, prompt, GEN, drafter=drafter)
        assert out.tokens == ar_tokens(tiny, prompt)
    if draft == "target" and oracle:
        assert out.stats.origins["draft2"] > 0  # draft2 really speculated the draft


@pytest.mark.parametrize("draft", ["target", "random"])
def test_staged_up_to_the_context_limit(tiny, drafts, draft):
    from specstack.drafting.staged import StagedDrafter

    max_len = tiny.lm.config.max_seq_len
    rnd = random.Random(11)
    drafter = StagedDrafter(drafts[draft], RandomProposals(3), TreeParams(width=3, budget=20, depth=6))
    for n_prompt in (max_len - 12, max_len - 3, max_len - 1):
        prompt = [rnd.randrange(257) for _ in range(n_prompt)]
        assert generate(tiny.lm, prompt, GEN, drafter=drafter).tokens == ar_tokens(tiny, prompt)


@pytest.mark.parametrize("length", [None, (1, 8), (7, 32), "cost"], ids=["tree", "dynamic1-8", "dynamic7-32", "cost"])
def test_ngram_drafter_greedy_equals_autoregressive(tiny, length):
    from specstack.drafting.batch_length import BassLength
    from specstack.drafting.katz import KatzTrigram
    from specstack.drafting.ngram import STAGED_WIDTHS, NgramDrafter

    corpus = [[_rnd.randrange(257) for _ in range(400)] for _ in range(3)] + [ar_tokens(tiny, p) for p in PROMPTS[:4]]
    # "cost": a cost curve flat to 4 tokens, then twice as dear (the int4 CPU shape)
    curve = [1.0, 1.05, 1.1, 1.15, 2.0, 2.1, 2.2]
    rule = (lambda: one_row_rule(curve)) if length == "cost" else (lambda: BassLength(*length)) if length else None
    longest = 0 if rule is None else len(curve) - 1 if length == "cost" else length[1]
    drafter = NgramDrafter(KatzTrigram.train(corpus, vocab_size=257), widths=(1,) * longest or STAGED_WIDTHS,
                           max_n=6 if rule else 3)
    lengths = set()
    for prompt in PROMPTS[:6]:
        out = generate(tiny.lm, prompt, GEN, drafter=drafter, length=rule and rule())
        assert out.tokens == ar_tokens(tiny, prompt)
        lengths |= {s.tree_size for s in out.stats.steps}
    if length:  # the chain really changed length (the corpus holds some outputs: long runs get accepted)
        assert len(lengths) > 1


# bf16 spacing for |logit| in [2, 4) is 1/64; the tiny models' logits stay below 4: four steps
TINY_BF16_TIE = 4 / 64


@pytest.mark.parametrize("shape", ["chain4", "tree4-36-8-4"])
def test_int4_target_across_the_wide_kernel_switch(tiny_models, random_draft, shape):
    """An int4 target multiplies by its dense bf16 copy from `wide_rows` rows on (prefill of the longer
    prompts, the 37-token tree) and by the int4 kernel below (decode, the 5-token chain). Its logits are
    bf16, so as in test_bf16_near_ties the output may part from its own autoregressive greedy output
    only on a near-tie of the target (a bf16 step or two at these logit sizes)."""
    from specstack.bench.ties import first_divergence, tie_gap
    from specstack.models.loading import load_model

    target = load_model(str(tiny_models["llama"].path), dtype="int4", use_cache=False, tokenizer=False)
    wide = target.model.layers[0].qkv.wide_rows
    assert wide is not None and 5 < wide < 37
    refs = {tuple(p): generate(target, p, GEN).tokens for p in PROMPTS[4:]}  # 8 to 89 tokens
    for draft in (target, random_draft):
        drafter = ModelDrafter(draft, SHAPES[shape])
        for prompt in PROMPTS[4:]:
            ref = refs[tuple(prompt)]
            out = generate(target, prompt, GEN, drafter=drafter).tokens
            i = first_divergence(ref, out)
            if i is None:
                continue
            # the target's logits where the reference chose ref[i], on the reference's own path: the
            # prompt in one forward, then one token at a time (the int4 kernel). One forward over
            # prompt + ref[:i] would take the dense copy, a third rounding of the same logits.
            cache = target.model.new_cache(1)
            logits = target.model.extend(torch.tensor([prompt]), cache).logits[0, -1]
            for t in ref[:i]:
                logits = target.model.extend(torch.tensor([[t]]), cache).logits[0, -1]
            assert logits.abs().max() < 4
            gap = tie_gap(logits, ref[i], out[i])
            assert gap <= TINY_BF16_TIE, f"prompt of {len(prompt)}: divergence at {i}, {gap} below the top"
