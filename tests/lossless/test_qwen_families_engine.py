"""The real pair's block families in the engine: on the tiny Qwen2 (q/k/v biases) and Qwen3 (q/k norms, a head
size apart from d_model / heads, tied embeddings) targets of tests/conftest.py, every kind of drafter (a
draft model's chains and trees, staged with draft2, the n-gram drafter, a self-draft) emits exactly the
target's greedy tokens in fp32, one sequence and in a batch beside rows of other drafters. The suite's other
engine tests run on llama and gpt2 (tests/families.py); these few keep the Qwen blocks' caches, biases and
norms honest under tree verification and ragged batches."""
from __future__ import annotations

import random

import pytest
from lossless.test_greedy_equality import RandomProposals

from specstack.config import GenerationConfig
from specstack.drafting.katz import KatzTrigram
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.ngram import NgramDrafter
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import BatchEngine, BatchRequest, generate

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN = ("qwen2", "qwen3")
_rnd = random.Random(29)
PROMPTS = [[_rnd.randrange(3, 257) for _ in range(n)] for n in (1, 4, 11, 30, 7)]
GEN = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
SHAPES = {"chain4": TreeParams.chain(4), "tree3-20-5-2": TreeParams(width=3, budget=20, depth=5, expand_per_forward=2)}


@pytest.fixture(params=QWEN, scope="module")
def qwen(request, tiny_models):
    return tiny_models[request.param]


@pytest.fixture(scope="module")
def alone(qwen):
    return {tuple(p): generate(qwen.lm, p, GEN).tokens for p in PROMPTS}


def drafters_of(qwen, self_drafts, random_draft, trigram) -> list:
    """One drafter per prompt, of every kind: a perfect draft's tree, a self-draft's chain, a random
    draft's chain, staged (the target drafting, draft2 proposing), the n-gram drafter."""
    return [ModelDrafter(qwen.lm, SHAPES["tree3-20-5-2"]),
            ModelDrafter(self_drafts[qwen.arch], SHAPES["chain4"]),
            ModelDrafter(random_draft, SHAPES["chain4"]),
            StagedDrafter(qwen.lm, RandomProposals(3, qwen.lm), TreeParams(width=3, budget=16, depth=5),
                          widths=(3, 2, 1)),
            NgramDrafter(trigram)]


@pytest.fixture(scope="module")
def trigram(qwen, alone):
    """A trigram that knows some of the target's outputs, so n-gram chains get accepted."""
    corpus = [[_rnd.randrange(257) for _ in range(300)]] + [alone[tuple(p)] for p in PROMPTS[:3]]
    return KatzTrigram.train(corpus, vocab_size=257)


def test_every_drafter_alone_equals_autoregressive(qwen, alone, self_drafts, random_draft, trigram):
    for i, drafter in enumerate(drafters_of(qwen, self_drafts, random_draft, trigram)):
        for prompt in PROMPTS:
            out = generate(qwen.lm, prompt, GEN, drafter=drafter)
            assert out.tokens == alone[tuple(prompt)], f"{qwen.arch}: drafter {i}, prompt of {len(prompt)} tokens"
        if i == 0:  # the target drafting for itself: every verified token accepted, so trees really ran
            assert out.stats.tau > 2


@pytest.mark.parametrize("layout", ["pad", "split"])
def test_every_drafter_in_one_batch_equals_each_row_alone(qwen, alone, self_drafts, random_draft, trigram, layout):
    drafters = drafters_of(qwen, self_drafts, random_draft, trigram)
    engine = BatchEngine(qwen.lm, max_rows=3, max_context=128, layout=layout, step_tokens=24)
    requests = [BatchRequest(p, GEN, drafter=d) for p, d in zip(PROMPTS, drafters, strict=True)]
    requests.append(BatchRequest(PROMPTS[2], GEN))  # a plain row beside the speculating ones
    results = engine.run(requests)
    for req, out in zip(requests, results, strict=True):
        assert out.tokens == alone[tuple(req.prompt_ids)], f"{qwen.arch} {layout}: prompt of {len(req.prompt_ids)} tokens"
