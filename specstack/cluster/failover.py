"""Failover in Ray Serve's HTTP proxy: a replica that dies under a request is not the client's problem.

When a replica's actor dies (killed, out of memory, its node gone), Ray Serve's proxy ends the
requests it had: one that had not answered yet gets no response at all (uvicorn then writes a bare
500), and a stream that had begun stops mid-body. Ray replaces the replica by itself; this ASGI
middleware, run inside every proxy, makes the requests' side of it clean:

- **Retry while nothing was sent.** The proxy's answer is held back until its first body bytes, and
  the request body is kept, so a request whose replica failed before answering is sent again (the
  router then picks a live replica), up to RETRIES times. A completion has no side effects, so a
  retry is safe; it is not done for a client that has gone.
- **Otherwise a clear error.** A stream that had begun gets one last SSE event with an OpenAI error
  body (the `openai` client raises it as an APIError), then its end; a request out of retries gets a
  503 with an OpenAI error body and Retry-After.
- **OpenAI-shaped errors from the proxy itself.** The proxy's own error answers (503 while no replica is
  up, 408 on its timeout, 404 for a path no deployment serves) are plain text; they are rewritten as
  OpenAI error JSON with the same status.

Ray Serve installs proxy middlewares from the function named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
in the proxy's environment (`proxy_middlewares` below): deploy.py sets it for the Ray instance it
starts; a cluster started with `ray start` needs it set there (docs/server.md, "Replicas").
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "specstack.cluster.failover:proxy_middlewares"
RETRIES = 2
BACKOFF_S = (0.1, 0.5)  # before the first and the second retry: Ray marks the dead replica meanwhile
ERROR_KINDS = {404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's proxy callback: the middlewares its HTTP proxy wraps its app in."""
    return [Middleware(Failover)]


def error_body(message: str, status: int, code: str | None = None) -> bytes:
    kind = ERROR_KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


@dataclass
class Attempt:
    """What one pass through the proxy did: `started` once the client has the status line (nothing
    can be retried after it), `finished` once the body is complete, `gone` if the client left."""

    started: bool = False
    finished: bool = False
    gone: bool = False
    held: Message | None = None  # the response start, until its first body bytes
    error_text: list[bytes] = field(default_factory=list)  # a plain-text error body being rewritten


class Failover:
    def __init__(self, app: ASGIApp, retries: int = RETRIES) -> None:
        self.app, self.retries = app, retries

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client left while sending
            return
        for tries in range(self.retries + 1):
            attempt = await self.attempt(scope, body, receive, send)
            if attempt.finished or attempt.gone:
                return
            if attempt.started:  # a stream cut mid-body: end it with an error the client can read
                message = "the replica serving this request stopped; the text so far is incomplete"
                await send({"type": "http.response.body", "more_body": False,
                            "body": b"data: " + error_body(message, 503, "replica_failed") + b"\n\n"})
                return
            if tries < self.retries:
                await asyncio.sleep(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)])
        message = f"the replicas failed to answer this request ({self.retries + 1} tries); retry later"
        await send_json(send, 503, error_body(message, 503, "replica_failed"), {"retry-after": "1"})

    async def attempt(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> Attempt:
        a = Attempt()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            message = await receive()  # after the body, the client's real events: its disconnect
            if message["type"] == "http.disconnect":
                a.gone = True
            return message

        async def forward(message: Message) -> None:
            if message["type"] == "http.response.start":
                a.held = message
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            last = not message.get("more_body", False)
            if a.held is not None and plain_error(a.held):
                a.error_text.append(message.get("body", b""))
                if last:
                    status = a.held["status"]
                    text = b"".join(a.error_text).decode(errors="replace").strip() or f"HTTP {status}"
                    a.held, a.started, a.finished = None, True, True
                    await send_json(send, status, error_body(text, status), {})
                return
            if a.held is not None:
                await send(a.held)
                a.held, a.started = None, True
            await send(message)
            a.finished = last

        try:
            await self.app({**scope}, replay, forward)
        except Exception as e:  # the proxy failed this pass: retried or reported like a dead replica
            print(f"specstack: proxy: {type(e).__name__}: {e}", file=sys.stderr)
        return a  # a held status line with no body after it: the answer never came (retried)


def plain_error(start: Message) -> bool:
    """An error status whose body is not JSON: the proxy's own text, not the replica's OpenAI error."""
    if start["status"] < 400:
        return False
    headers = {k.lower(): v for k, v in start.get("headers", [])}
    return not headers.get(b"content-type", b"").startswith(b"application/json")


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body (the replica reads it whole anyway), or None if the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
