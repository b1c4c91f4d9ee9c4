"""What every route reads and checks: the server's state (set up before the model loads, completed once it
has), the API key, the model name, the body's size and JSON, and the model's fill-in-the-middle template."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from specstack import fim
from specstack.fim import FimTemplate
from specstack.server.metrics import ServerMetrics
from specstack.server.protocol import (
    ApiError,
    bad,
)
from specstack.server.serving_completion import DEFAULT_COMPLETION_TOKENS
from specstack.server.worker import EngineWorker

# a request body: a whole 32k-token context is well under 1 MB as text or as token ids; a larger body is
# refused before it is read, not tokenized first and refused by the context check
MAX_BODY_BYTES = 2 << 20


@dataclass
class ServerState:
    """What the routes read: set up before the model loads, completed by `ready` once it has."""

    model_id: str
    api_key: str | None
    metrics: ServerMetrics
    worker: EngineWorker | None = None
    tokenizer: Any = None
    vocab_size: int = 0
    max_context: int = 0
    method: str = ""
    load_error: str | None = None
    created: int = 0
    fim: FimTemplate | str = "the model is still loading"  # its FIM template, or why it has none

    def ready(self, worker: EngineWorker, tokenizer: Any, vocab_size: int, max_context: int, method: str,
              fim: FimTemplate | str = "this server has no fill-in-the-middle template") -> None:
        self.tokenizer, self.vocab_size, self.max_context, self.method = tokenizer, vocab_size, max_context, method
        self.fim = fim
        self.created = int(time.time())
        self.worker = worker  # last: a request that sees the worker sees everything above


def prefix_cache_state(worker: EngineWorker) -> dict[str, Any] | None:
    """How full the prefix cache is (None: the server runs without one). Read off the engine thread: a
    size a step old at worst."""
    cache = worker.engine.prefix
    if cache is None:
        return None
    return {"bytes": cache.nbytes, "allocated_bytes": cache.allocated_bytes, "capacity_bytes": cache.max_bytes,
            "tokens": cache.tokens,
            "usage": round(cache.nbytes / cache.max_bytes, 4)}


def authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
        raise ApiError(401, "Incorrect API key provided (send Authorization: Bearer KEY)", code="invalid_api_key")


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_id:
        raise ApiError(404, f"The model {name!r} does not exist; this server serves {state.model_id!r}",
                       "model", "model_not_found", "not_found_error")


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "specstack",
            "max_model_len": state.max_context, "speculation": state.method}


async def read_json(request: Request) -> object:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB")
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON ({e})") from None


def fim_template(state: ServerState, param: str) -> FimTemplate:
    """The model's FIM template, or a 400 saying it has none."""
    if isinstance(state.fim, str):
        raise bad(state.fim, param, "fim_unsupported")
    return state.fim


def fim_budget(state: ServerState, new_tokens: int | None) -> int:
    """Prompt tokens a FIM prompt may take in one of this server's rows (fim.budget; no max_tokens: the
    completions route's default)."""
    return fim.budget(state.max_context, new_tokens or DEFAULT_COMPLETION_TOKENS)


def loaded(state: ServerState) -> EngineWorker:
    if state.worker is None:
        raise ApiError(503, "the model is still loading", type="service_unavailable_error", code="loading",
                       headers={"Retry-After": "1"})
    return state.worker

