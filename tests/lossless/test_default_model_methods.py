"""Greedy equality on the real default model: every speculative method emits exactly the tokens of
autoregressive greedy decoding, with an fp32 target and with w8a8 and w4a8 ones (the batch-invariant
quantized formats: exact there too, where int4 and bf16 part from `ar` on near-ties). Few prompts, short outputs:
this is the slow end-to-end check the tiny-model tests cannot give (a real tokenizer, GGUF weights,
int4 drafts beside the target)."""
from __future__ import annotations

import pytest

from specstack.config import GenerationConfig
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt

PROMPTS = [
    'def has_close_elements(numbers, threshold):\n    """Check if any two numbers are closer than threshold."""\n',
    "The three primary colours are",
]
METHODS = ["chain:k=3", "tree:width=3,budget=12,depth=4,expand=3", "ngram", "ngram:width=12,depth=6", "ngram:depth=2,max=8",
           "ngram:max=6,cost=1,match=6",
           "staged:width=3,budget=16,depth=5", "staged:budget=8,cost=1,d2=3", "tree:budget=8,cost=1"]


@pytest.fixture(scope="module", params=["fp32", "w8a8", "w4a8"])
def target(request):
    return load_model("smollm2-135m", dtype=request.param)


@pytest.fixture(scope="module")
def references(target):
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    out = {}
    for text in PROMPTS:
        ids = encode_prompt(target.tokenizer, text)
        out[text] = (ids, generate(target, ids, gen).tokens)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_method_equals_autoregressive_greedy(target, references, method):
    spec = parse_method(method)
    drafter = build_drafter(spec, target, DraftSources.for_model("smollm2-135m"))
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    for text, (ids, ref) in references.items():
        result = generate(target, ids, gen, drafter=drafter, length=length_rule(spec, target))
        assert result.tokens == ref, f"{method} diverged on {text!r}"
        assert result.stats.target_forwards <= len(ref)  # never more forwards than tokens
