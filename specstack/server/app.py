"""The OpenAI-compatible routes (DESIGN §8), a thin adapter over the engine thread (worker.py).

Routes: `POST /v1/completions` (with OpenAI's `suffix`: fill in the middle) and `POST /v1/chat/completions`
(both streaming as SSE with `data: [DONE]`, or whole), `POST /infill` (llama.cpp's, for editors:
server/infill.py), `GET /v1/models`, `GET /health` (503 while the model loads, then 200), `GET /metrics`
(Prometheus text) and `GET /` (a page that streams a prompt's answer coloured by token origin: page.html). A handler reads and checks its body (protocol.py), encodes the
prompts, checks them against a row's context, submits one job per choice and relays the engine
thread's events; it never runs a forward. A client that goes away (a closed stream, or a dropped
connection while it waits for a whole response) cancels its jobs, which leave the batch at the next step.

Every error is OpenAI's JSON error shape with its status: 400 bad body or field or over-long prompt,
401 wrong key, 404 unknown model or route, 413 body too large, 503 loading or queue full (with
Retry-After), 500 an engine failure; never a traceback.
"""
from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specstack.engine.stats import GenerationResult
from specstack.engine.stopping import Span
from specstack.errors import SpecstackError
from specstack.fim import encode_fim
from specstack.prompts import check_text, encode_chat, encode_prompt
from specstack.server.infill import LlamaError
from specstack.server.infill_route import fill
from specstack.server.jobs import ClientGone, Events, collect, engine_failure, prepare, sink_into, submit
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
from specstack.server.state import (
    ServerState,
    authorize,
    check_model,
    fim_budget,
    fim_template,
    loaded,
    model_card,
    prefix_cache_state,
    read_json,
)
from specstack.server.worker import EngineWorker, Event, finish_reason

PAGE = Path(__file__).with_name("page.html")  # the page at /: prompt, streamed text coloured by origin, metrics


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

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

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

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        try:
            return await fill(state, request)
        except LlamaError:
            raise
        except ApiError as e:  # the shared checks' errors, in llama.cpp's shape on its route
            raise LlamaError(e.status, e.message, type=e.type, headers=e.headers) from None

    return app


# ---------------------------------------------------------------------------------------------------


def encode(state: ServerState, prompt: Prompt, new_tokens: int | None = None) -> list[int]:
    try:
        if prompt.suffix is not None:
            check_text(prompt.suffix)
            return encode_fim(state.tokenizer, fim_template(state, "suffix"), prompt.text or "", prompt.suffix,
                              budget=fim_budget(state, new_tokens)).ids
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


# ---------------------------------------------------------------------------------------------------
# The two completion routes
# ---------------------------------------------------------------------------------------------------
async def complete(state: ServerState, request: Request, route: Route) -> Response:
    authorize(state, request)
    worker = loaded(state)
    req = parse_request(route, await read_json(request))
    check_model(state, req.model)
    encoded = [encode(state, p, req.max_tokens) for p in req.prompts]
    limits = [new_tokens(state, req, len(ids)) for ids in encoded]
    # a FIM middle also ends at its template's end tokens (the model would go on to another file)
    stops = fim_template(state, "suffix").end_ids(state.tokenizer) if req.prompts[0].suffix is not None else ()
    reply = Reply(route, state.model_id, sum(len(ids) for ids in encoded))
    events: Events = asyncio.Queue()
    sink = sink_into(events)
    if len(encoded) * req.n > worker.capacity:  # would wait for room forever
        raise bad(f"{len(encoded) * req.n} choices (prompts x n) are more than this server holds at once "
                  f"({worker.capacity})", "n")
    await prepare(worker, req.method)
    jobs = [(ids, req.generation(limit, j, stops), sink(p * req.n + j))
            for p, (ids, limit) in enumerate(zip(encoded, limits, strict=True)) for j in range(req.n)]
    ids = submit(worker, jobs, req.method, req.origins)
    if req.stream:
        return StreamingResponse(stream(worker, reply, req, events, ids), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    spans: dict[int, list[Span]] | None = {} if req.origins else None
    try:
        finals = await collect(worker, request, events, ids, spans)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    choices = [(finals[i].text, finish_reason(finals[i])) for i in range(len(ids))]
    return JSONResponse(reply.response(choices, sum(len(r.tokens) for r in finals.values()),
                                       cached_tokens(finals, req.n), spans))


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
                yield reply.chunk(index, event.text, usage_field=usage, spans=event.spans if req.origins else None)
            if event.result is not None:
                tokens[index] = len(event.result.tokens)
                results[index] = event.result
                yield reply.chunk(index, None, finish_reason(event.result), usage_field=usage)
        if usage:
            yield reply.usage_chunk(sum(tokens.values()), cached_tokens(results, req.n))
        yield DONE
    finally:
        worker.cancel(ids)
