"""Greedy equality under a request's logits rules, on the default model in fp32 (a real tokenizer, so a
real grammar): with a JSON schema, penalties and a bias, `ar` emits exactly what a plain decode does
(one token a forward, the rules applied by hand), and every speculative method emits
exactly `ar`'s tokens with the same rules; log-probabilities, the output's and the prompt's (`echo`),
are a plain forward's, whichever method verified the tokens."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from specstack.config import GenerationConfig, GrammarSpec, Penalties, SamplingParams
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
from specstack.grammar import allowed, apply_masks, compiler_for
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


class Recorder:
    """A drafter that records the trees it proposes, with the tokens emitted before each; `strip` drops
    the request's rule from its context (as a drafter that ignored it would propose)."""

    def __init__(self, inner, strip: bool) -> None:
        self.inner, self.strip, self.seen = inner, strip, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def group(self):
        return None

    def propose(self, ctx):
        if self.strip:
            ctx = dataclasses.replace(ctx, rule=None)
        tree = self.inner.propose(ctx)
        self.seen.append((list(ctx.tokens), tree))
        return tree


def refused_drafts(lm, ids, seen, grammar) -> tuple[int, int]:
    """(draft nodes the grammar refuses on their path, draft nodes) over the recorded proposals."""
    compiler = compiler_for(lm.tokenizer, lm.config.vocab_size, lm.eos_token_ids)
    refused = total = 0
    for tokens, tree in seen:
        matcher = compiler.matcher(grammar)
        matcher.commit(tokens[len(ids):])
        bits = matcher.tree_masks(tree)
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parent, strict=True)):
            if tree.origin[i] != "draft":
                continue
            total += 1
            refused += token not in lm.eos_token_ids and not allowed(bits[parent + 1], token)
    return refused, total


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_drafter_proposes_only_what_the_grammar_allows(lm, ids, temperature):
    """The request's rules reach the draft's own logits (its q): a draft model under a JSON schema drafts
    only tokens the schema allows on their path. Without the rule (the control) it drafts refused ones,
    which verification rejects: the same tokens come out, more slowly."""
    grammar = OPTIONS["json_schema"]["grammar"]
    spec = parse_method("tree:width=3,budget=12,depth=4,expand=3")
    counts, texts = {}, {}
    for strip in (False, True):
        drafter = Recorder(build_drafter(spec, lm, DraftSources.for_model("smollm2-135m")), strip)
        gen = GenerationConfig(max_new_tokens=N, grammar=grammar,
                               sampling=SamplingParams(temperature=temperature, top_k=0, seed=3))
        texts[strip] = generate(lm, ids, gen, drafter=drafter, length=length_rule(spec, lm)).tokens
        counts[strip] = refused_drafts(lm, ids, drafter.seen, grammar)
    assert counts[False][1] > 0 and counts[False][0] == 0, counts
    assert counts[True][0] > 0, counts  # the control: the draft alone does not know the grammar
    if temperature == 0:
        assert texts[False] == texts[True]


def test_a_draft_reading_the_targets_activations_drafts_beside_forced_tokens(lm, ids, references):
    """A grammar's forced tokens are the tree of a row whose drafter reads the target's activations (SPIRe)
    as of any other row, and that drafter writes their memories from the target's activations of them. A
    perfect such draft (every target block, each reading its own input: it computes the target) stays
    perfect across forced tokens: every node it proposes is accepted, which a lost or misplaced memory
    breaks."""
    from lossless.conftest import spire_lm

    drafter = ModelDrafter(spire_lm(lm, list(range(lm.config.n_layers)), mix="own"), TreeParams.chain(4))
    out = generate(lm, ids, GenerationConfig(max_new_tokens=N, **OPTIONS["json_schema"]), drafter=drafter)
    assert out.tokens == references["json_schema"].tokens
    assert "grammar" in out.origins and "draft" in out.origins, out.origins
    steps = out.stats.steps[:-1]  # the last may stop inside its tree
    assert [s.accepted for s in steps] == [s.tree_size for s in steps]


def test_a_trial_of_the_draft_leaves_forced_tokens_to_every_row(lm, ids, references):
    """While the length rule lets no row draft with its model (a trial of none), rows whose grammar forces
    tokens still take them as their trees (they cost no draft forward): every row of a batch under a JSON
    schema has grammar tokens, and each equals its greedy decode."""
    from specstack.drafting.batch_length import FixedLength
    from specstack.engine.batched import BatchEngine, BatchRequest

    class NoneTries(FixedLength):
        def trial(self) -> int | None:
            return 0

    spec = parse_method("chain:k=4")
    drafters = [build_drafter(spec, lm, DraftSources.for_model("smollm2-135m")) for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=N, **OPTIONS["json_schema"])
    engine = BatchEngine(lm, max_rows=3, length=NoneTries(None))
    results = engine.run([BatchRequest(ids, gen, drafter=d) for d in drafters])
    for out in results:
        assert out.tokens == references["json_schema"].tokens
        assert "grammar" in out.origins and "draft" not in out.origins, out.origins
