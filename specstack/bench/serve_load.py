"""The load generator of `specstack bench-serve`: streamed requests against any OpenAI-compatible
endpoint (ours, vLLM, llama.cpp's llama-server), level after level. What is sent is serve_settings.py's
(levels, settings, the plan of a level), how it is encoded and read back serve_wire.py's, and the
statistics of each level serve_stats.py's.

Requests go through httpx with the SSE lines parsed here, not through the openai client: on a 2-core
machine the client's per-chunk pydantic parsing takes CPU from the server under test, and that would
show up as the server's latency.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from specstack import interrupt
from specstack.bench.datasets import Prompt
from specstack.bench.serve_settings import (
    Level,
    LoadSettings,
    RequestRow,
    Target,
    arrival_times,
    disconnect_set,
    requests_for,
)
from specstack.bench.serve_stats import LevelResult, RunResult, summarize_level
from specstack.bench.serve_wire import (
    ERROR_CHARS,
    chunk_choice,
    chunk_text,
    endpoint_of,
    error_message,
    parse_rss,
    path_of,
    request_body,
    sse_data,
    usage_counts,
)
from specstack.errors import SpecstackError

CANCEL_AFTER = 2  # content chunks a --disconnect request reads before it closes its stream
CHECK_TOKENS = 8  # max_tokens of the one check request sent before the first level (not measured)
_POLL_S = 0.2  # how often a running level looks for a Ctrl-C (interrupt.check)


def client(target: Target, connections: int | None, timeout: float) -> httpx.AsyncClient:
    """One pool for a level, sized to its concurrency (None: unbounded, for an open loop), so no request
    waits on the client's pool instead of the server."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout), headers=target.headers())


def unreachable(url: str, e: Exception) -> SpecstackError:
    reason = " ".join(str(e).split()) or type(e).__name__
    return SpecstackError(f"cannot reach {url}: {reason} (is the server running there?)")


async def _get(http: httpx.AsyncClient, url: str, timeout: float) -> httpx.Response:
    try:
        return await http.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        raise unreachable(url, e) from None


async def resolve_model(http: httpx.AsyncClient, url: str, model: str | None, timeout: float) -> str:
    """`model`, else the first id of GET {url}/models. The GET is also the reachability probe: a refused
    connection or a refused key is one clear error before any generation is asked."""
    r = await _get(http, url + "/models", timeout)
    if r.status_code in (401, 403):
        raise SpecstackError(f"GET {url}/models: {r.status_code} {error_message(r.content)} (check --api-key)")
    if model:
        return model  # a server without /models is fine when the name is given
    if r.status_code != 200:
        raise SpecstackError(f"GET {url}/models: {r.status_code} {error_message(r.content)}; give --model")
    try:
        ids = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise SpecstackError(f"GET {url}/models did not answer an OpenAI model list; give --model") from None
    if not ids:
        raise SpecstackError(f"GET {url}/models lists no model; give --model")
    return str(ids[0])


async def server_rss(http: httpx.AsyncClient, root: str) -> int | None:
    """The server's resident memory from {root}/metrics, or None (no such route or metric: not an error)."""
    try:
        r = await http.get(root + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_rss(r.text) if r.status_code == 200 else None


async def send(http: httpx.AsyncClient, url: str, body: Mapping[str, Any], row: RequestRow, t0: float,
               timeout: float, cancel_after: int | None = None) -> RequestRow:
    """Send one streamed request and fill `row` as its events arrive (t0: the level's start)."""
    sent = time.perf_counter()
    row.sent_s = sent - t0
    parts: list[str] = []
    seen: set[int] = set()  # choice indices with content
    last = sent
    done = False
    try:
        async with asyncio.timeout(timeout), http.stream("POST", url, json=body) as resp:
            row.http_status = resp.status_code
            if resp.status_code != 200:
                row.error = error_message(await resp.aread())
                return row
            async for line in resp.aiter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    row.error = f"not JSON in the stream: {data[:80]!r}"
                    return row
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    row.error = error_message(json.dumps(event))
                    return row
                usage = event.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    row.usage_tokens = usage["completion_tokens"]
                prompt_tokens, cached = usage_counts(event)
                row.prompt_tokens = prompt_tokens if prompt_tokens is not None else row.prompt_tokens
                row.cached_tokens = cached if cached is not None else row.cached_tokens
                text = chunk_text(event)
                if not text:
                    continue
                seen.add(chunk_choice(event))
                row.choices = len(seen)
                now = time.perf_counter()
                if row.chunks == 0:
                    row.ttft_s = now - sent
                else:
                    row.itl_s.append(now - last)
                last = now
                row.chunks += 1
                parts.append(text)
                if cancel_after is not None and row.chunks >= cancel_after:
                    row.status = "cancelled"  # leaving the block closes the connection mid-stream
                    break
    except TimeoutError:
        row.error = f"no complete answer within --timeout {timeout:g} s"
    except httpx.HTTPError as e:
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:ERROR_CHARS]
    finally:
        row.e2e_s = time.perf_counter() - sent
        row.text = "".join(parts)
    if row.status == "cancelled" or row.error is not None:
        return row
    if not done:
        row.error = "the stream ended before data: [DONE]"
        return row
    row.status = "ok"
    row.output_tokens = row.usage_tokens if row.usage_tokens is not None else row.chunks
    return row


async def wait_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Wait for every task, looking for a Ctrl-C between polls (asyncio.run cancels the rest on the way out)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=_POLL_S)
        for t in done:
            t.result()  # a bug in a task surfaces here, not as a silent missing row
        interrupt.check()


async def run_level(target: Target, s: LoadSettings, level: Level, prompts: Sequence[Prompt]) -> LevelResult:
    """Send one level's requests (prompts in order, cycling) and wait for all of them."""
    n = requests_for(level, len(prompts), s.requests)
    cancel = disconnect_set(n, s.disconnect, s.seed, level.name)
    rows: list[RequestRow] = []
    bodies, urls = [], []
    for i in range(n):
        p = prompts[i % len(prompts)]
        ep = endpoint_of(p, s.endpoint)
        rows.append(RequestRow(level.name, i, i % len(prompts), ep))
        bodies.append(request_body(p, ep, target.model, s))
        urls.append(target.url + path_of(ep))

    def go(http: httpx.AsyncClient, i: int, t0: float) -> Any:
        return send(http, urls[i], bodies[i], rows[i], t0, s.timeout, CANCEL_AFTER if i in cancel else None)

    closed = level.kind == "concurrency"
    async with client(target, int(level.value) if closed else None, s.timeout) as http:
        t0 = time.perf_counter()
        if closed:
            queue = iter(range(n))  # the clients take the requests in order, each as its last one ends

            async def worker() -> None:
                for i in queue:
                    interrupt.check()
                    await go(http, i, t0)

            tasks = [asyncio.create_task(worker()) for _ in range(min(n, int(level.value)))]
        else:
            tasks = []
            for i, at in enumerate(arrival_times(n, level.value, s.seed, level.name)):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                interrupt.check()
                tasks.append(asyncio.create_task(go(http, i, t0)))
        await wait_all(tasks)
        wall = max((r.sent_s + (r.e2e_s or 0.0) for r in rows), default=0.0)
        rss = await server_rss(http, target.root)
    return LevelResult(level, rows, wall, rss)


async def check_request(target: Target, s: LoadSettings, prompt: Prompt) -> dict[str, Any]:
    """One short request before the first level: a server that refuses the endpoint, the model or
    an --extra-body field says so once, as an error, instead of in every row; it also warms the server
    up (not measured)."""
    ep = endpoint_of(prompt, s.endpoint)
    row = RequestRow("check", 0, 0, ep)
    async with client(target, 1, s.timeout) as http:
        await send(http, target.url + path_of(ep), request_body(prompt, ep, target.model, s, min(CHECK_TOKENS, s.max_tokens)),
                   row, time.perf_counter(), s.timeout)
    if row.status != "ok":
        status = f" {row.http_status}" if row.http_status and row.http_status != 200 else ""
        raise SpecstackError(f"the check request to {target.url}{path_of(ep)} failed{status}: {row.error}")
    return {"endpoint": ep, "seconds": row.e2e_s, "output_tokens": row.output_tokens, "chunks": row.chunks}


async def run_async(url: str, model: str | None, api_key: str | None, s: LoadSettings, levels: Sequence[Level],
                    prompts: Sequence[Prompt], progress: Callable[[LevelResult], None] | None = None) -> RunResult:
    target = Target(url, "", api_key)
    async with client(target, 1, s.timeout) as http:
        target = Target(url, await resolve_model(http, url, model, min(s.timeout, 30.0)), api_key)
        rss_before = await server_rss(http, target.root)
    result = RunResult(target, s, [], rss_before)
    result.check = await check_request(target, s, prompts[0])
    for level in levels:
        lr = await run_level(target, s, level, prompts)
        result.levels.append(lr)
        if progress:
            progress(lr)
    return result


def run(url: str, model: str | None, api_key: str | None, s: LoadSettings, levels: Sequence[Level],
        prompts: Sequence[Prompt], progress: Callable[[LevelResult], None] | None = None) -> RunResult:
    """The whole run: resolve the model (GET /models), the server's memory before, one check request,
    then every level in order (progress called after each)."""
    if not prompts:
        raise SpecstackError("no prompts to send")
    return asyncio.run(run_async(url.rstrip("/"), model, api_key, s, levels, prompts, progress))


def progress_line(lr: LevelResult) -> str:
    """The one stderr line after a level."""
    s = summarize_level(lr.level, lr.rows, lr.wall_s)

    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v:.0f} ms"

    tps = "–" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
    return (f"{lr.level.describe()}: {s['ok']} ok, {s['errors']} errors, {s['cancelled']} cancelled in "
            f"{lr.wall_s:.1f} s; {tps} tokens/s; TTFT p50 {ms(s['ttft_ms_p50'])}, ITL p50 {ms(s['itl_ms_p50'])}")
