"""The OpenAI-compatible routes (DESIGN §8), a thin adapter over the engine thread (worker.py).

Routes: `POST /v1/completions` (with OpenAI's `suffix`: fill in the middle) and `POST /v1/chat/completions`
(server/serving.py over their routes, serving_completion.py and serving_chat.py)
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

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specstack.server.infill import LlamaError
from specstack.server.infill_route import fill
from specstack.server.protocol import ApiError
from specstack.server.serving import complete
from specstack.server.serving_chat import CHAT
from specstack.server.serving_completion import COMPLETIONS
from specstack.server.state import ServerState, authorize, check_model, model_card, prefix_cache_state

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
        return await complete(state, request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(state, request, CHAT)

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
