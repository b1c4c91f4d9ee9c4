"""bf16 losslessness (DESIGN §2.1): a T-token verification forward and T one-token forwards round
differently in bf16, so greedy speculative output may part from autoregressive output. Where it does,
the divergence must sit on a near-tie of the target: both tokens within TIE_TOLERANCE of its top
logit at that point (specstack.bench.ties, which checks whole bench runs the same way). Anything
else is a bug."""
from __future__ import annotations

import pytest
import torch

from specstack.bench.ties import TIE_TOLERANCE, first_divergence, tie_gap
from specstack.config import GenerationConfig
from specstack.engine.batched import generate
from specstack.engine.methods import (
    DraftSources,
    build_drafter,
    parse_method,
)
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt

PROMPTS = [
    'from typing import List\n\n\ndef below_zero(operations: List[int]) -> bool:\n    """Return True if the balance ever falls below zero."""\n',
    "def is_palindrome(text: str) -> bool:\n",
    "import math\n\n\ndef circle_area(radius):\n",
]


@pytest.fixture(scope="module")
def target():
    return load_model("smollm2-135m", dtype="bf16")


def step_logits(lm, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after `ids`, computed the autoregressive way."""
    cache = lm.model.new_cache(1, len(ids) + 1)
    return lm.model.extend(torch.tensor([ids]), cache).logits[0, -1]


@pytest.mark.parametrize("method", ["ngram:width=12,depth=6", "chain:k=3"])
def test_bf16_divergences_are_near_ties(target, method):
    gen = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
    drafter = build_drafter(parse_method(method), target, DraftSources.for_model("smollm2-135m"))
    for text in PROMPTS:
        ids = encode_prompt(target.tokenizer, text)
        ref = generate(target, ids, gen).tokens
        out = generate(target, ids, gen, drafter=drafter).tokens
        assert len(out) == len(ref)
        if out == ref:
            continue
        i = first_divergence(ref, out)
        logits = step_logits(target, ids + ref[:i])
        gap = tie_gap(logits, ref[i], out[i])
        assert gap <= TIE_TOLERANCE, f"{method}: divergence at token {i}, {gap} below the top logit"
