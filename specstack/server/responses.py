"""OpenAI's response bodies and stream chunks for /v1/completions and /v1/chat/completions: the frame they
share (id, object, created, model; index, logprobs, finish_reason; usage) here, each choice's own part
from its Route (serving_chat.py, serving_completion.py)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specstack.engine.stats import GenerationResult
from specstack.engine.stopping import Span
from specstack.server.protocol import Route


@dataclass
class Choice:
    """One choice of a whole response: its text (None: a chat answer that is tool calls alone), why it
    ended, its log-probabilities in the route's shape, its tool calls (chat)."""

    text: str | None
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Reply:
    """One request's answer as it is built: the id, time and model every chunk repeats."""

    route: Route
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.route.id_prefix + uuid.uuid4().hex

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """cached_tokens: prompt tokens taken from the prefix cache instead of read (OpenAI's field)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ------------------------------------------------------------------------------
    def response(self, choices: list[Choice], completion_tokens: int, cached_tokens: int,
                 spans: dict[int, list[Span]] | None = None) -> dict[str, Any]:
        """choices: in index order; spans: each choice's text by origin (asked for)."""
        items = [{"index": i, **self.route.choice_body(c.text, c.tool_calls), "logprobs": c.logprobs,
                  "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
        if spans is not None:
            for i, item in enumerate(items):
                item["origins"] = [list(p) for p in spans.get(i, [])]
        return {**self._head(self.route.object), "choices": items, "usage": self.usage(completion_tokens, cached_tokens)}

    # -- stream chunks --------------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              first: bool = False, usage_field: bool = False, spans: tuple[Span, ...] | None = None,
              logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None) -> str:
        """One SSE event with one choice's piece of text (`first`: a chat stream's role delta; `spans`: the
        piece cut at its tokens, each part with their origin, as `origins`: [[text, origin], ...];
        `logprobs`: its tokens' in the route's shape; `tool_calls`: chat tool-call deltas)."""
        choice = {"index": index, **self.route.chunk_body(text, first, tool_calls), "logprobs": logprobs,
                  "finish_reason": finish_reason}
        body = {**self._head(self.route.chunk_object), "choices": [choice]}
        if spans is not None:
            choice["origins"] = [list(p) for p in spans]
        if usage_field:  # stream_options.include_usage: every chunk has "usage": null but the last
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> str:
        return sse({**self._head(self.route.chunk_object), "choices": [], "usage": self.usage(completion_tokens, cached_tokens)})


def cached_tokens(results: dict[int, GenerationResult], n: int) -> int:
    """A request's prompt tokens served from the prefix cache: per prompt, the fewest any of its n choices
    took (the n samples of a new prompt read it once and copy it: 0, as the prompt was read)."""
    prompts = (len(results) + n - 1) // n
    return sum(min(results[p * n + j].stats.cached_tokens for j in range(n) if p * n + j in results)
               for p in range(prompts))


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
