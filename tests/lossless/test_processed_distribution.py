"""Sampling losslessness under a request's logits rules (processing.py): with a grammar, penalties and a
bias, rows that draft (a draft model's chains and trees verified by recursive rejection sampling, staged
trees by sample-walk, a grammar's forced tokens hung onto them), interleaved in the same batches with
rows that do not, emit sequences distributed exactly as the target's own processed, warped conditionals.

The V = 8 tiny target and draft (lossless/conftest.py) with a tokenizer of single letters a..g and <eos>;
the grammar `[a-f] g [a-e]` forces its middle token (so the engine drafts it, origin `grammar`), and the
penalties make the third token depend on the first. Expected: p(x1) p(x3 | x1, g), each p the target's
logits masked and penalised by hand (not by processing.py), then warped. Chi-square with pooled cells;
the thresholds of the test add up to a false-failure probability of 1e-4 for its fixed seeds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from chisq import chi2_pvalue
from lossless.test_sampling_equivalence import PROMPT, NextTwo, V
from unit.test_processing import letters_tokenizer, reference_penalties

from specstack.config import GenerationConfig, GrammarSpec, Penalties, SamplingParams
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.sampling import warp

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4
GRAMMAR = GrammarSpec("lark", 'start: /[a-f]/ "g" /[a-e]/')
ALLOWED = [set(range(6)), {6}, set(range(5))]  # the grammar's tokens at positions 0, 1, 2
PEN = Penalties(presence=0.8, frequency=0.5, repetition=1.3)
BIAS = ((1, 0.7),)
SAMPLING = SamplingParams(temperature=1.0)
KINDS = {
    "ar": lambda draft: None,
    "chain": lambda draft: ModelDrafter(draft, TreeParams.chain(3)),
    "tree": lambda draft: ModelDrafter(draft, TreeParams(width=2, budget=4, depth=2, expand_per_forward=2)),
    "staged": lambda draft: StagedDrafter(draft, NextTwo(), TreeParams(width=2, budget=6, depth=3), widths=(2, 1)),
}
ROWS = 600  # per kind


def expected_p(target, generated: list[int]) -> torch.Tensor:
    """The processed, warped target distribution after PROMPT + generated, computed by hand."""
    model = target.model
    logits = model.extend(torch.tensor([PROMPT + generated]), model.new_cache(1)).logits[0, -1].float()
    logits = reference_penalties(logits, PROMPT, generated, PEN)
    for token, bias in BIAS:
        logits[token] += bias
    refused = [t for t in range(V) if t not in ALLOWED[len(generated)]]
    logits[refused] = float("-inf")
    return warp(logits, SAMPLING).double()


def test_processed_rows_follow_the_processed_target(vocab8):
    target, draft = vocab8
    # the letters' end token (7) is the model's only one, so the grammar's mask and the stream agree on it
    target = dataclasses.replace(target, tokenizer=letters_tokenizer(),
                                 config=dataclasses.replace(target.config, eos_token_ids=(7,)))
    gen = dict(max_new_tokens=3, stop_on_eos=False, grammar=GRAMMAR, penalties=PEN, logit_bias=BIAS)
    requests, kinds = [], []
    for i in range(ROWS * len(KINDS)):
        kind = list(KINDS)[i % len(KINDS)]
        g = GenerationConfig(**gen, sampling=dataclasses.replace(SAMPLING, seed=90_000 + i))
        requests.append(BatchRequest(PROMPT, g, drafter=KINDS[kind](draft), speculate=kind != "ar"))
        kinds.append(kind)
    results = BatchEngine(target, max_rows=48, max_context=24).run(requests)
    p1 = expected_p(target, [])
    expected = np.stack([p1[a].item() * expected_p(target, [a, 6]).numpy() for a in range(V)])
    for kind in KINDS:
        rows = [r for r, k in zip(results, kinds, strict=True) if k == kind]
        counts = np.zeros((V, V))
        for out in rows:
            assert out.tokens[1] == 6, out.tokens  # the grammar's forced token
            counts[out.tokens[0], out.tokens[2]] += 1
        if kind != "ar":
            origins = [o for out in rows for o in out.origins]
            assert origins.count("grammar") > ROWS // 4, f"{kind}: the forced token was (almost) never drafted by the grammar"
        p = chi2_pvalue(counts, expected)
        assert p > ALPHA / len(KINDS), f"{kind}: p = {p:.2e}"
