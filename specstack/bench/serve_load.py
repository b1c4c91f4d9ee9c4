"""The load generator of `specstack bench-serve`: streamed requests against any OpenAI-compatible
endpoint (ours, vLLM, llama.cpp's llama-server), level after level, and the statistics of each level.

Terms:
- a *level* is one setting of the load: `concurrency C` (closed loop: C clients, each sending its next
  request when its last one ends) or `rate R` (open loop: requests arrive at R per second, Poisson, seeded,
  however many are in flight);
- a *content chunk* is a streamed event that carries output text (a chat stream's role-only first delta,
  the usage chunk and empty texts are not content). A speculative server may put several tokens in one
  chunk, so the inter-token latency here is per chunk (ITL), and `tokens_per_chunk` says how many;
- TTFT: from sending a request to its first content chunk; e2e: to the end of its stream; TPOT: (e2e -
  TTFT) / (tokens - 1), the time per output token after the first, comparable across chunkings;
- a request ends `ok`, `error` (an HTTP status, a network failure, an error event, a timeout, a stream
  cut before `data: [DONE]`) or `cancelled`: closed by us after its first CANCEL_AFTER content chunks
  (--disconnect: a client going away mid-stream; neither an error nor counted in the tokens);
- output tokens: the final `usage.completion_tokens` when the server sends it, else the content chunks.

Requests go through httpx with the SSE lines parsed here, not through the openai client: on a 2-core
machine the client's per-chunk pydantic parsing takes CPU from the server under test, and that would
show up as the server's latency.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from specstack import interrupt
from specstack.bench.datasets import Prompt
from specstack.errors import SpecstackError

ENDPOINTS = ("completions", "chat")
CANCEL_AFTER = 2  # content chunks a --disconnect request reads before it closes its stream
CHECK_TOKENS = 8  # max_tokens of the one check request sent before the first level (not measured)
ERROR_CHARS = 200  # of a server's error message kept in a row
_POLL_S = 0.2  # how often a running level looks for a Ctrl-C (interrupt.check)


# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where the requests go: `url` is the API base (`http://host:port/v1`)."""
    url: str
    model: str
    api_key: str | None = None

    @property
    def root(self) -> str:
        """The server's root (the url without a trailing /v1): where /metrics and /health live."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Level:
    """One load setting: `concurrency` clients in a closed loop, or `rate` requests/s (Poisson)."""
    kind: Literal["concurrency", "rate"]
    value: float

    @property
    def name(self) -> str:
        return f"c{self.value:g}" if self.kind == "concurrency" else f"r{self.value:g}"

    def describe(self) -> str:
        return f"concurrency {self.value:g}" if self.kind == "concurrency" else f"rate {self.value:g}/s"


@dataclass(frozen=True)
class LoadSettings:
    """What every request asks, and how many are sent per level."""
    endpoint: str | None = None  # completions | chat | None: per prompt (a chat prompt goes to chat)
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    disconnect: float = 0.0  # share of each level's requests that close their stream early
    seed: int = 0
    timeout: float = 600.0  # seconds per request, from sending it to the end of its stream
    requests: int | None = None  # per level; None: requests_for's default
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every body


@dataclass
class RequestRow:
    """One request of a level. Times are seconds; sent_s counts from the level's start."""
    level: str
    index: int  # within the level, in sending order
    prompt: int  # index into the prompt list
    endpoint: str
    status: str = "error"  # ok | error | cancelled
    http_status: int | None = None
    error: str | None = None
    sent_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    e2e_s: float | None = None
    chunks: int = 0  # content chunks
    usage_tokens: int | None = None  # the final usage.completion_tokens, if sent
    output_tokens: int = 0
    text: str = ""


@dataclass
class LevelResult:
    level: Level
    rows: list[RequestRow]
    wall_s: float
    rss_after: int | None = None

    def summary(self, greedy: bool) -> dict[str, Any]:
        s = summarize_level(self.level, self.rows, self.wall_s)
        s["consistency"] = consistency(self.rows) if greedy else None
        s["server_rss_bytes_after"] = self.rss_after
        return s


@dataclass
class RunResult:
    target: Target
    settings: LoadSettings
    levels: list[LevelResult]
    rss_before: int | None = None
    check: dict[str, Any] = field(default_factory=dict)  # the check request: status, seconds, tokens

    @property
    def greedy(self) -> bool:
        return self.settings.temperature == 0

    def rows(self) -> list[RequestRow]:
        return [r for lv in self.levels for r in lv.rows]


# ---------------------------------------------------------------------------------------------------
# Pure parts: request plan, bodies, SSE, statistics
# ---------------------------------------------------------------------------------------------------
def requests_for(level: Level, prompts: int, requests: int | None) -> int:
    """Requests sent at a level: `requests` if given, else every prompt once and at least 4 per client
    (4 x C; 4 x R for a rate: about 4 s of arrivals), so each client's start and end are a small part."""
    if requests is not None:
        return requests
    return max(prompts, math.ceil(4 * level.value))


def _rng(seed: int, salt: str) -> random.Random:
    # a string seed is hashed with SHA-512 (random.seed version 2): the same on every run and machine
    return random.Random(f"{seed}/{salt}")


def disconnect_set(n: int, share: float, seed: int, salt: str = "") -> frozenset[int]:
    """Which of n requests close their stream early: round(share x n) of them, chosen by the seed."""
    k = min(n, round(share * n))
    return frozenset(_rng(seed, "disconnect/" + salt).sample(range(n), k))


def arrival_times(n: int, rate: float, seed: int, salt: str = "") -> list[float]:
    """Seconds from a level's start at which its n requests are sent: a Poisson process of `rate`
    per second (exponential gaps), the first at 0 so a level starts with work."""
    rng = _rng(seed, "arrivals/" + salt)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def endpoint_of(prompt: Prompt, endpoint: str | None) -> str:
    return endpoint or ("chat" if prompt.chat else "completions")


def request_body(prompt: Prompt, endpoint: str, model: str, s: LoadSettings, max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request for `prompt` (a chat request holds it as one user message)."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    body.update(max_tokens=max_tokens or s.max_tokens, temperature=s.temperature, stream=True,
                stream_options={"include_usage": True})
    if s.ignore_eos:
        body["ignore_eos"] = True  # read by vLLM and llama-server (and ours): exactly max_tokens, equal work
    body.update(s.extra_body)
    return body


def path_of(endpoint: str) -> str:
    return "/chat/completions" if endpoint == "chat" else "/completions"


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for anything else (comments, event names, blank lines)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def chunk_text(event: Mapping[str, Any]) -> str:
    """The output text of one streamed event of either endpoint (choice 0: one completion per request)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def error_message(body: bytes | str) -> str:
    """A server's error in one short line: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    text = " ".join(text.split())
    return text[:ERROR_CHARS] + ("..." if len(text) > ERROR_CHARS else "")


_RSS = re.compile(r"^process_resident_memory_bytes(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def parse_rss(metrics: str) -> int | None:
    """process_resident_memory_bytes from Prometheus text (prometheus_client's process collector)."""
    m = _RSS.search(metrics)
    if not m:
        return None
    try:
        return int(float(m.group(1)))
    except ValueError:
        return None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else 1e3 * p


def summarize_level(level: Level, rows: Sequence[RequestRow], wall_s: float) -> dict[str, Any]:
    """One level's numbers. Throughput counts ok requests only (a cancelled request's tokens are not
    work the client used); latencies are over ok requests, in milliseconds."""
    ok = [r for r in rows if r.status == "ok"]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]
    errors = Counter(f"{r.http_status} {r.error}" if r.http_status else str(r.error) for r in rows if r.status == "error")
    return {
        "level": level.name, "kind": level.kind, "value": level.value, "requests": len(rows), "ok": len(ok),
        "errors": sum(errors.values()), "cancelled": sum(r.status == "cancelled" for r in rows),
        "wall_s": wall_s, "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p99": _ms(ttft, 99),
        "itl_ms_p50": _ms(itl, 50), "itl_ms_p99": _ms(itl, 99),
        "e2e_ms_p50": _ms(e2e, 50), "e2e_ms_p99": _ms(e2e, 99),
        "tpot_ms_p50": _ms(tpot, 50), "tpot_ms_p99": _ms(tpot, 99),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "error_messages": dict(errors.most_common(5)),
    }


def consistency(rows: Sequence[RequestRow]) -> dict[str, Any]:
    """Greedy decoding gives one text per prompt: the prompts whose ok requests disagree (a request
    given another's state, a corrupted batch row). Only meaningful at temperature 0."""
    texts: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        if r.status == "ok":
            texts[r.prompt].add(r.text)
    bad = sorted(p for p, t in texts.items() if len(t) > 1)
    return {"prompts_checked": sum(len(t) > 0 for t in texts.values()), "mismatched": len(bad), "mismatched_prompts": bad}


def row_dict(r: RequestRow) -> dict[str, Any]:
    return asdict(r)


# ---------------------------------------------------------------------------------------------------
# Talking to the server
# ---------------------------------------------------------------------------------------------------
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
                text = chunk_text(event)
                if not text:
                    continue
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


async def _wait_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
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
        await _wait_all(tasks)
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
