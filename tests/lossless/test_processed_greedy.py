"""Greedy equality under a request's logits rules, on the default model in fp32 (a real tokenizer, so a
real grammar): with a JSON schema, penalties and a bias, `ar` emits exactly what a plain decode does
(one token a forward, the rules applied by hand), and every speculative method emits
exactly `ar`'s tokens with the same rules; log-probabilities, the output's and the prompt's (`echo`),
are a plain forward's, whichever method verified the tokens."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specstack.config import GenerationConfig, GrammarSpec, Penalties
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
from specstack.grammar import apply_masks, compiler_for
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt
from specstack.tree import DraftTree

PROMPT = "Give a JSON record of a person with a name, an age and a favourite colour."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "colour": {"enum": ["red", "green", "blue"]},
                                           "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "age", "colour", "pets"], "additionalProperties": False}
# a chain is a tree of width one: the trees are where paths part
METHODS = ["tree:width=3,budget=12,depth=4,expand=3", "ngram", "staged:width=3,budget=16,depth=5"]
N = 32
OPTIONS = {
    "json_schema": dict(grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
    "penalties": dict(penalties=Penalties(presence=0.6, frequency=0.4, repetition=1.2)),
    "bias": dict(logit_bias=((28, 9.0), (30, -3.0))),  # `=` and `?`
}


@pytest.fixture(scope="module")
def lm():
    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="module")
def ids(lm):
    return encode_prompt(lm.tokenizer, PROMPT, chat=True)


def plain_greedy(lm, ids: list[int], gen: GenerationConfig) -> list[int]:
    """Decode one token a forward (a plain cache, no tree), the rules applied by hand."""
    model, out = lm.model, []
    cache = model.new_cache(1, len(ids) + gen.max_new_tokens)
    step = ids
    matcher = compiler_for(lm.tokenizer, lm.config.vocab_size, lm.eos_token_ids).matcher(gen.grammar) \
        if gen.grammar is not None else None
    for _ in range(gen.max_new_tokens):
        logits = model.extend(torch.tensor([step]), cache, logit_rows=slice(-1, None)).logits[0, -1].float().clone()
        if not gen.penalties.off:  # OpenAI's and vLLM's rules, over the whole vocabulary at once
            pen = gen.penalties
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            seen = (counts > 0) | torch.isin(torch.arange(logits.shape[0]), torch.tensor(ids))
            logits = torch.where(seen & (pen.repetition != 1), torch.where(logits > 0, logits / pen.repetition,
                                                                           logits * pen.repetition), logits)
            logits = logits - pen.frequency * counts - pen.presence * (counts > 0).float()
        for token, bias in gen.logit_bias:
            logits[token] += bias
        if matcher is not None:
            logits = apply_masks(logits[None], matcher.tree_masks(DraftTree()))[0]
        token = int(logits.argmax())
        if token in lm.eos_token_ids:
            break
        out.append(token)
        step = [token]
        if matcher is not None:
            matcher.commit([token])
    return out


@pytest.fixture(scope="module")
def references(lm, ids):
    return {name: generate(lm, ids, GenerationConfig(max_new_tokens=N, **opts)) for name, opts in OPTIONS.items()}


@pytest.mark.parametrize("option", ["json_schema", "bias"])
def test_ar_with_rules_is_a_plain_decode_with_them(lm, ids, references, option):
    gen = GenerationConfig(max_new_tokens=N, **OPTIONS[option])
    assert references[option].tokens == plain_greedy(lm, ids, gen)
    assert references[option].tokens != generate(lm, ids, GenerationConfig(max_new_tokens=N)).tokens  # they matter


def test_ar_with_penalties_is_a_plain_decode_with_them(lm, ids, references):
    gen = GenerationConfig(max_new_tokens=N, **OPTIONS["penalties"])
    assert references["penalties"].tokens == plain_greedy(lm, ids, gen)


def test_json_schema_output_is_valid(references):
    out = references["json_schema"]
    assert out.finish_reason == "eos", out.text  # the grammar ended it
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("method", METHODS)
def test_methods_with_rules_equal_ar_with_them(lm, ids, references, method):
    spec = parse_method(method)
    drafter = build_drafter(spec, lm, DraftSources.for_model("smollm2-135m"))
    for name, opts in OPTIONS.items():
        result = generate(lm, ids, GenerationConfig(max_new_tokens=N, **opts), drafter=drafter, length=length_rule(spec, lm))
        assert result.tokens == references[name].tokens, f"{method} diverged with {name}"


def plain_logprobs(lm, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, V]: log-softmax of one forward over the whole sequence, row j scoring token j + 1."""
    model = lm.model
    return torch.log_softmax(model.extend(torch.tensor([tokens]), model.new_cache(1, len(tokens))).logits[0, :-1].float(), -1)


@pytest.mark.parametrize("method", ["ar", "staged:width=3,budget=16,depth=5"])
def test_logprobs_are_a_plain_forwards(lm, ids, method):
    gen = GenerationConfig(max_new_tokens=20, logprobs=3, prompt_logprobs=True, stop_on_eos=False)
    spec = parse_method(method)
    drafter = build_drafter(spec, lm, DraftSources.for_model("smollm2-135m"))
    out = generate(lm, ids, gen, drafter=drafter, length=length_rule(spec, lm) if drafter else None)
    ref = plain_logprobs(lm, ids + out.tokens)
    assert [lp.token for lp in out.logprobs] == out.tokens
    for j, lp in enumerate(out.prompt_logprobs + out.logprobs):
        row = ref[j]
        assert lp.token == (ids + out.tokens)[j + 1]
        assert abs(lp.logprob - float(row[lp.token])) < 1e-4, j
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist(), j
    assert len(out.prompt_logprobs) == len(ids) - 1
