"""A request's jobs on the engine thread, from the event loop's side: submitted (all or none), their events
relayed into the handler's queue, collected, and cancelled when the client goes away."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request

from specstack.config import GenerationConfig
from specstack.engine.stats import GenerationResult
from specstack.engine.stopping import Span
from specstack.errors import SpecstackError
from specstack.server.protocol import (
    ApiError,
    bad,
)
from specstack.server.worker import EngineWorker, Event, Overloaded, Sink


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


async def prepare(worker: EngineWorker, method: str | None) -> None:
    """A method of the request's own: built (a draft loaded) before the request queues."""
    if method is None:
        return
    try:
        await asyncio.to_thread(worker.prepare, method)
    except SpecstackError as e:
        raise bad(f"speculation.method {method!r} cannot run on this server: {e}", "speculation",
                  "method_unavailable") from None


def submit(worker: EngineWorker, jobs: list[tuple[list[int], GenerationConfig, Sink]], method: str | None,
           spans: bool) -> list[int]:
    try:
        return worker.submit(jobs, method, spans=spans)
    except Overloaded:
        raise ApiError(503, f"the server is at capacity ({worker.capacity} requests in flight); retry later",
                       type="service_unavailable_error", code="queue_full", headers={"Retry-After": "1"}) from None


Events = asyncio.Queue[tuple[int, Event]]


def sink_into(events: Events) -> Callable[[int], Sink]:
    """Job index -> the engine thread's way into this event loop's queue."""
    loop = asyncio.get_running_loop()

    def sink(index: int) -> Sink:
        def put(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the loop has closed (shutdown): nobody is listening
                pass

        return put

    return sink


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
                  ids: list[int], spans: dict[int, list[Span]] | None = None) -> dict[int, GenerationResult]:
    """Every job's result, or ClientGone (its jobs cancelled). `spans`: filled with each job's text pieces
    and their origins, where the jobs were asked for them."""
    gone = asyncio.ensure_future(disconnected(request))
    finals: dict[int, GenerationResult] = {}
    try:
        while len(finals) < len(ids):
            index, event = await next_event(events, gone)
            if event.error is not None:
                raise engine_failure(event)
            if spans is not None:
                spans.setdefault(index, []).extend(event.spans)
            if event.result is not None:
                finals[index] = event.result
        return finals
    finally:
        gone.cancel()
        worker.cancel(ids)  # the finished ones are ignored; the rest leave the batch at the next step
