"""The OpenAI-compatible routes (DESIGN §8), a thin adapter over the engine thread (worker.py).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (both streaming as SSE with
`data: [DONE]`, or whole), `GET /v1/models`, `GET /health` (503 while the model loads, then 200) and
`GET /metrics` (Prometheus text). A handler reads and checks its body (protocol.py), encodes the
prompts, checks them against a row's context, submits one job per choice and relays the engine
thread's events; it never runs a forward. A client that goes away (a closed stream, or a dropped
connection while it waits for a whole response) cancels its jobs, which leave the batch at the next step.

Every error is OpenAI's JSON error shape with its status: 400 bad body or field or over-long prompt,
401 wrong key, 404 unknown model or route, 413 body too large, 503 loading or queue full (with
Retry-After), 500 an engine failure; never a traceback.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specstack.engine.stats import GenerationResult
from specstack.errors import SpecstackError
from specstack.prompts import encode_chat, encode_prompt
from specstack.server.metrics import ServerMetrics
from specstack.server.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    CompletionRequest,
    Prompt,
    Route,
    bad,
    parse_request,
)
from specstack.server.responses import DONE, Reply, cached_tokens, sse
from specstack.server.worker import EngineWorker, Event, Overloaded, finish_reason

MAX_BODY_BYTES = 16 << 20  # a request body; a prompt of a whole context is well under 1 MB


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

    def ready(self, worker: EngineWorker, tokenizer: Any, vocab_size: int, max_context: int, method: str) -> None:
        self.tokenizer, self.vocab_size, self.max_context, self.method = tokenizer, vocab_size, max_context, method
        self.created = int(time.time())
        self.worker = worker  # last: a request that sees the worker sees everything above


def prefix_cache_state(worker: EngineWorker) -> dict[str, Any] | None:
    """How full the prefix cache is (None: the server runs without one). Read off the engine thread: a
    size a step old at worst."""
    cache = worker.engine.prefix
    if cache is None:
        return None
    return {"bytes": cache.nbytes, "capacity_bytes": cache.max_bytes, "tokens": cache.tokens,
            "usage": round(cache.nbytes / cache.max_bytes, 4)}


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


def create_app(state: ServerState, routes: Callable[[FastAPI], None] | None = None) -> FastAPI:
    """The routes over `state`. `routes` adds routes first, so they take a path before the server's own
    (a Ray Serve replica's /health and /metrics, which answer for all replicas: cluster/replica.py)."""
    app = FastAPI(title="specstack", docs_url=None, redoc_url=None, openapi_url=None)
    if routes is not None:
        routes(app)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception) -> JSONResponse:
        traceback.print_exception(e, file=sys.stderr)  # the log has the bug; the client a clean error
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.worker is not None:
            return JSONResponse({"status": "ok", "prefix_cache": prefix_cache_state(state.worker)})
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(state, request)
        return JSONResponse({"object": "list", "data": [model_card(state)]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        authorize(state, request)
        check_model(state, model)
        return JSONResponse(model_card(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(state, request, "chat")

    return app


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------
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


def encode(state: ServerState, prompt: Prompt) -> list[int]:
    try:
        if prompt.messages is not None:
            return encode_chat(state.tokenizer, prompt.messages)
        if prompt.text is not None:
            return encode_prompt(state.tokenizer, prompt.text)
    except SpecstackError as e:
        raise bad(str(e), "messages" if prompt.messages is not None else "prompt") from None
    ids = prompt.ids or []
    if any(t >= state.vocab_size for t in ids):
        raise bad(f"prompt: token ids must be below the vocabulary size {state.vocab_size}", "prompt")
    return ids


def new_tokens(state: ServerState, req: CompletionRequest, prompt_len: int) -> int:
    """The tokens a choice may generate: max_tokens, which must fit the row's context with the prompt;
    without it the route's default, capped by the room left."""
    room = state.max_context - prompt_len
    if room < 1:
        raise bad(f"This model's maximum context length is {state.max_context} tokens; the prompt has "
                  f"{prompt_len} tokens, which leaves no room for the completion", "prompt", "context_length_exceeded")
    if req.max_tokens is None:
        return min(room, DEFAULT_COMPLETION_TOKENS) if req.route == "completions" else room
    if req.max_tokens > room:
        raise bad(f"This model's maximum context length is {state.max_context} tokens; you requested "
                  f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, {req.max_tokens} for the "
                  "completion)", "max_tokens", "context_length_exceeded")
    return req.max_tokens


# ---------------------------------------------------------------------------------------------------
# The two completion routes
# ---------------------------------------------------------------------------------------------------
async def complete(state: ServerState, request: Request, route: Route) -> Response:
    authorize(state, request)
    worker = state.worker
    if worker is None:
        raise ApiError(503, "the model is still loading", type="service_unavailable_error", code="loading",
                       headers={"Retry-After": "1"})
    req = parse_request(route, await read_json(request))
    check_model(state, req.model)
    encoded = [encode(state, p) for p in req.prompts]
    limits = [new_tokens(state, req, len(ids)) for ids in encoded]
    reply = Reply(route, state.model_id, sum(len(ids) for ids in encoded))
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink(index: int):  # the engine thread's way into this event loop
        def put(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the loop has closed (shutdown): nobody is listening
                pass

        return put

    if len(encoded) * req.n > worker.capacity:  # would wait for room forever
        raise bad(f"{len(encoded) * req.n} choices (prompts x n) are more than this server holds at once "
                  f"({worker.capacity})", "n")
    if req.method is not None:  # a method of its own: built (a draft loaded) before the request queues
        try:
            await asyncio.to_thread(worker.prepare, req.method)
        except SpecstackError as e:
            raise bad(f"speculation.method {req.method!r} cannot run on this server: {e}", "speculation",
                      "method_unavailable") from None
    jobs = [(ids, req.generation(limit, j), sink(p * req.n + j))
            for p, (ids, limit) in enumerate(zip(encoded, limits, strict=True)) for j in range(req.n)]
    try:
        ids = worker.submit(jobs, req.method)
    except Overloaded:
        raise ApiError(503, f"the server is at capacity ({worker.capacity} requests in flight); retry later",
                       type="service_unavailable_error", code="queue_full", headers={"Retry-After": "1"}) from None
    if req.stream:
        return StreamingResponse(stream(worker, reply, req, events, ids), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        finals = await collect(worker, request, events, ids)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    choices = [(finals[i].text, finish_reason(finals[i])) for i in range(len(ids))]
    return JSONResponse(reply.response(choices, sum(len(r.tokens) for r in finals.values()),
                                       cached_tokens(finals, req.n)))


async def disconnected(request: Request) -> None:
    """Returns when the client has closed the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_event(events: asyncio.Queue[tuple[int, Event]], gone: asyncio.Future[None]) -> tuple[int, Event]:
    """The next event of this request's jobs; ClientGone if the client leaves first."""
    get = asyncio.ensure_future(events.get())
    either: set[asyncio.Future[Any]] = {get, gone}
    done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if get not in done:
        get.cancel()
        raise ClientGone()
    return get.result()


def engine_failure(event: Event) -> ApiError:
    return ApiError(500, event.error or "internal error", type="server_error")


async def collect(worker: EngineWorker, request: Request, events: asyncio.Queue[tuple[int, Event]],
                  ids: list[int]) -> dict[int, GenerationResult]:
    """Every job's result, or ClientGone (its jobs cancelled)."""
    gone = asyncio.ensure_future(disconnected(request))
    finals: dict[int, GenerationResult] = {}
    try:
        while len(finals) < len(ids):
            index, event = await next_event(events, gone)
            if event.error is not None:
                raise engine_failure(event)
            if event.result is not None:
                finals[index] = event.result
        return finals
    finally:
        gone.cancel()
        worker.cancel(ids)  # the finished ones are ignored; the rest leave the batch at the next step


async def stream(worker: EngineWorker, reply: Reply, req: CompletionRequest,
                 events: asyncio.Queue[tuple[int, Event]], ids: list[int]) -> AsyncIterator[str]:
    """SSE: each choice's text as its row releases it, one last chunk per choice with its finish reason,
    the usage chunk if asked, then [DONE]. Closing the stream cancels what has not finished: Starlette's
    StreamingResponse watches for the disconnect itself (ASGI spec 2.3, as uvicorn speaks it) and cancels
    this generator, or (spec 2.4) its next write fails; either way `finally` runs."""
    usage = req.include_usage
    tokens: dict[int, int] = {}
    results: dict[int, GenerationResult] = {}
    try:
        if reply.route == "chat":  # the assistant's role first, as OpenAI streams it
            for i in range(len(ids)):
                yield reply.chunk(i, None, first=True, usage_field=usage)
        while len(tokens) < len(ids):
            index, event = await events.get()
            if event.error is not None:
                yield sse(engine_failure(event).body())
                return
            if event.text:
                yield reply.chunk(index, event.text, usage_field=usage)
            if event.result is not None:
                tokens[index] = len(event.result.tokens)
                results[index] = event.result
                yield reply.chunk(index, None, finish_reason(event.result), usage_field=usage)
        if usage:
            yield reply.usage_chunk(sum(tokens.values()), cached_tokens(results, req.n))
        yield DONE
    finally:
        worker.cancel(ids)
