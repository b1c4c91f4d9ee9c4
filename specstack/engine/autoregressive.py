"""Autoregressive decoding: the baseline every speed-up is measured against, and the reference
output every lossless method must reproduce."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specstack.config import GenerationConfig
from specstack.engine.stats import RunStats
from specstack.engine.stopping import FinishReason, TokenStream
from specstack.models.loading import LoadedModel
from specstack.prompts import check_context
from specstack.sampling import make_generator, next_token


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: RunStats = field(default_factory=RunStats)


def generate(lm: LoadedModel, prompt_ids: Sequence[int], gen: GenerationConfig,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    model, cfg = lm.model, lm.config
    check_context(len(prompt_ids), cfg.max_seq_len)
    max_new = min(gen.max_new_tokens, cfg.max_seq_len - len(prompt_ids))
    stream = TokenStream(lm.tokenizer, max_new, lm.eos_token_ids if gen.stop_on_eos else (),
                         gen.stop_strings, on_text)
    stats = RunStats(prompt_tokens=len(prompt_ids))
    cache = model.new_cache(1, len(prompt_ids) + max_new)
    rng = make_generator(gen.sampling, model.device)

    # 1. prefill the prompt and take the first token from its last position
    t0 = time.perf_counter()
    tokens = torch.tensor([list(prompt_ids)], device=model.device)
    logits = model.extend(tokens, cache).logits[:, -1]
    tok = next_token(logits, gen.sampling, rng)
    stream.push([int(tok)])
    t1 = time.perf_counter()
    stats.prefill_seconds = t1 - t0
    # 2. one forward per further token
    while not stream.done:
        logits = model.extend(tok.view(1, 1), cache).logits[:, -1]
        stats.target_forwards += 1
        tok = next_token(logits, gen.sampling, rng)
        stream.push([int(tok)])
    stats.decode_seconds = time.perf_counter() - t1
    stats.new_tokens = len(stream.tokens)
    return GenerationResult(list(prompt_ids), stream.tokens, stream.text, stream.finish_reason or "length", stats)
