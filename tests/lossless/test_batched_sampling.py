"""Sampling in a batch (engine/batched.py): rows with different sampling parameters share every
forward and each follows its own. (1) Distribution: on the V = 8 tiny target, rows at three settings
(temperature 1; temperature 0.7 with top-k 3; temperature 1.3 with top-p 0.8), interleaved in the same
batches, emit pairs (x1, x2) distributed as p(x1) p(x2 | x1) of their own warp (chi-square, pooled
cells, thresholds adding up to 1e-4). (2) Exactness: a seeded row emits the very tokens of the same
prompt and seed decoded alone, whatever the other rows do."""
from __future__ import annotations

import numpy as np
import pytest
from chisq import chi2_pvalue
from lossless.test_sampling_equivalence import PROMPT, V, exact_pairs

from specstack.config import GenerationConfig, SamplingParams
from specstack.engine.batched import BatchEngine, BatchRequest, generate

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)]
ROWS = 1500  # per setting


def test_rows_follow_their_own_sampling_parameters(vocab8):
    target, _ = vocab8
    requests = [BatchRequest(PROMPT, GenerationConfig(max_new_tokens=2, stop_on_eos=False,
                                                      sampling=SamplingParams(**SETTINGS[i % 3], seed=50_000 + i)))
                for i in range(3 * ROWS)]
    results = BatchEngine(target, max_rows=64, max_context=16).run(requests)
    for s, args in enumerate(SETTINGS):
        counts = np.zeros((V, V))
        for out in results[s::3]:
            counts[out.tokens[0], out.tokens[1]] += 1
        p = chi2_pvalue(counts, exact_pairs(target, SamplingParams(**args)))
        assert p > ALPHA / len(SETTINGS), f"{args}: p = {p:.2e}"


def test_seeded_row_equals_the_same_seed_alone(tiny):
    gens = [GenerationConfig(max_new_tokens=12, stop_on_eos=False, sampling=SamplingParams(**args, seed=7 + i))
            for i, args in enumerate([*SETTINGS, dict(temperature=0.0)])]
    prompts = [[5, 9, 11], [40, 41, 42, 43, 44, 45, 46], [200], [17, 3, 99, 100]]
    results = BatchEngine(tiny.lm, max_rows=4, max_context=64, layout="split").run(
        [BatchRequest(p, g) for p, g in zip(prompts, gens, strict=True)])
    for p, g, out in zip(prompts, gens, results, strict=True):
        assert out.tokens == generate(tiny.lm, p, g).tokens, g.sampling
