"""What every generation loop sets up and hands back: the checks, the token stream, the stats, the
target's cache and the sampler's generator (one place, so the loops differ only in their steps)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specstack import interrupt
from specstack.cache import KVCache
from specstack.config import GenerationConfig
from specstack.engine.stats import RunStats
from specstack.engine.stopping import FinishReason, TokenStream
from specstack.models.base import LoadedModel
from specstack.prompts import check_context
from specstack.sampling import make_generator


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: RunStats = field(default_factory=RunStats)


@dataclass
class Session:
    prompt_ids: list[int]
    stream: TokenStream
    stats: RunStats
    cache: KVCache
    generator: torch.Generator | None

    def result(self) -> GenerationResult:
        self.stats.new_tokens = len(self.stream.tokens)
        return GenerationResult(self.prompt_ids, self.stream.tokens, self.stream.text,
                                self.stream.finish_reason or "length", self.stats)


def open_session(lm: LoadedModel, prompt_ids: Sequence[int], gen: GenerationConfig,
                 on_text: Callable[[str], None] | None, scratch: int = 0) -> Session:
    """Check the prompt against the context, cap the new tokens at what the context leaves, and
    size the cache for prompt + output + `scratch` slots of speculative blocks."""
    interrupt.check()  # a Ctrl-C while the model was loading stops the run before its prefill
    cfg = lm.config
    check_context(len(prompt_ids), cfg.max_seq_len)
    max_new = min(gen.max_new_tokens, cfg.max_seq_len - len(prompt_ids))
    stream = TokenStream(lm.tokenizer, max_new, lm.eos_token_ids if gen.stop_on_eos else (),
                         gen.stop_strings, on_text)
    cache = lm.model.new_cache(1, len(prompt_ids) + max_new + scratch)
    return Session(list(prompt_ids), stream, RunStats(prompt_tokens=len(prompt_ids)), cache,
                   make_generator(gen.sampling, lm.model.device))
