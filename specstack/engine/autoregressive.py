"""Autoregressive decoding: the baseline every speed-up is measured against, and the reference
output every lossless method must reproduce."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specstack import interrupt
from specstack.config import GenerationConfig
from specstack.engine.session import GenerationResult, open_session
from specstack.models.base import LoadedModel
from specstack.sampling import next_token

__all__ = ["GenerationResult", "generate"]


def generate(lm: LoadedModel, prompt_ids: Sequence[int], gen: GenerationConfig,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    model = lm.model
    run = open_session(lm, prompt_ids, gen, on_text)
    stream, stats, cache, rng = run.stream, run.stats, run.cache, run.generator

    # 1. prefill the prompt and take the first token from its last position
    t0 = time.perf_counter()
    tokens = torch.tensor([list(prompt_ids)], device=model.device)
    logits = model.extend(tokens, cache, logit_rows=slice(-1, None)).logits[:, -1]
    tok = next_token(logits, gen.sampling, rng)
    stream.push([int(tok)])
    t1 = time.perf_counter()
    stats.prefill_seconds = t1 - t0
    # 2. one forward per further token
    while not stream.done:
        interrupt.check()  # Ctrl-C stops the run here, between steps
        logits = model.extend(tok.view(1, 1), cache).logits[:, -1]
        stats.target_forwards += 1
        tok = next_token(logits, gen.sampling, rng)
        stream.push([int(tok)])
    stats.decode_seconds = time.perf_counter() - t1
    return run.result()
