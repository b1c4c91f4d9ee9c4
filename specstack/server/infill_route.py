"""`POST /infill`'s handler: the body read (infill.py), the FIM prompt built and fitted to a row, one job
submitted, and the answer whole or streamed in llama.cpp's shape."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specstack.engine.stopping import Span
from specstack.fim import encode_fim
from specstack.server.infill import InfillRequest, LlamaError, final_body, parse_infill, partial_body
from specstack.server.jobs import ClientGone, Events, collect, prepare, sink_into, submit
from specstack.server.responses import sse
from specstack.server.state import ServerState, authorize, fim_budget, loaded, read_json
from specstack.server.worker import EngineWorker


async def fill(state: ServerState, request: Request) -> Response:
    authorize(state, request)
    worker = loaded(state)
    req = parse_infill(await read_json(request))
    if isinstance(state.fim, str):
        raise LlamaError(400, f"Infill is not supported by this model: {state.fim}", type="not_supported_error")
    prompt = encode_fim(state.tokenizer, state.fim, req.prefix, req.suffix, req.extra, req.prompt,
                        budget=fim_budget(state, req.n_predict or state.max_context))
    room = state.max_context - len(prompt.ids)
    gen = req.generation(min(room, req.n_predict or room), state.fim.end_ids(state.tokenizer))
    events: Events = asyncio.Queue()
    await prepare(worker, req.method)
    ids = submit(worker, [(prompt.ids, gen, sink_into(events)(0))], req.method, req.origins)
    method = req.method or state.method
    if req.stream:
        return StreamingResponse(stream_infill(worker, req, events, ids, len(prompt.ids), state.model_id,
                                               prompt.truncated, method),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    spans: dict[int, list[Span]] | None = {} if req.origins else None
    try:
        finals = await collect(worker, request, events, ids, spans)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(final_body(req, finals[0], state.model_id, prompt.truncated, method,
                                   None if spans is None else spans.get(0, [])))


async def stream_infill(worker: EngineWorker, req: InfillRequest, events: Events, ids: list[int], prompt_tokens: int,
                        model: str, truncated: bool, method: str) -> AsyncIterator[str]:
    """llama.cpp's stream: a `data:` event per piece of text, the last one the whole answer (stop: true)."""
    try:
        while True:
            _, event = await events.get()
            if event.error is not None:
                yield sse(LlamaError(500, event.error, type="server_error").body())
                return
            if event.text:
                yield sse(partial_body(event.text, event.tokens, prompt_tokens, event.spans if req.origins else None))
            if event.result is not None:
                yield sse(final_body(req, event.result, model, truncated, method, None))
                return
    finally:
        worker.cancel(ids)
