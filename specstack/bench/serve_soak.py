"""`specstack bench-serve --workload soak`: many requests of a mixed workload against one server, its
memory sampled as they go (issue 54: a server meant to run for weeks must not grow).

What is sent (`soak_plan`, a pure function of the settings and the texts, seeded): short prompts (the
HumanEval prompts, cycling, so a prefix cache finds them again) and long ones (`long_chars` windows of
standard-library files at offsets on a coarse grid: some repeat, most are new, so a full cache keeps
evicting); each request is streamed, whole (not streamed), cancelled by the client after its first
chunks, or a bad body (the BAD_BODIES table) that the server must refuse with a 4xx. Closed loop:
`concurrency` requests in flight. After every `sample_every` requests ended (and at the start), one
`Sample` from the server's /metrics: its resident memory and its prefix cache's bytes, allocated pool
and budget. serve_soak_report.py turns the samples into the verdict, the files and the figure.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from specstack import interrupt
from specstack.bench.serve_load import client, resolve_model, send
from specstack.bench.serve_settings import LoadSettings, RequestRow, Target
from specstack.bench.serve_wire import ERROR_CHARS, error_message, gauge, parse_rss, streamed_body
from specstack.errors import SpecstackError

MODES = ("stream", "whole", "cancel", "bad")
CANCEL_AFTER = 2  # content chunks a cancelled request reads before it closes its stream
OFFSET_GRID = 2048  # long windows start on multiples of this (to a line start): some prompts repeat
Progress = Callable[[str], None]


def _not_json(model: str, text: str) -> bytes:
    return b'{"model": "' + model.encode() + b'", "prompt": '


# A bad body each: what a buggy client sends. Each is refused before it reaches the engine, with a 4xx.
BAD_BODIES: dict[str, Callable[[str, str], dict[str, Any] | bytes]] = {
    "not-json": _not_json,
    "negative-max-tokens": lambda model, text: {"model": model, "prompt": text, "max_tokens": -1},
    "unknown-model": lambda model, text: {"model": model + "-no-such-model", "prompt": text, "max_tokens": 4},
    "no-prompt": lambda model, text: {"model": model, "max_tokens": 4},
    "bad-temperature": lambda model, text: {"model": model, "prompt": text, "temperature": "hot"},
}


@dataclass(frozen=True)
class SoakSettings:
    requests: int = 2000
    concurrency: int = 8
    sample_every: int | None = None  # None: requests // 50 (at least 1)
    long_share: float = 0.2  # of the requests: a long prompt
    cancel_share: float = 0.1  # closed by the client after CANCEL_AFTER chunks
    bad_share: float = 0.05  # a bad body
    whole_share: float = 0.2  # not streamed (of all requests; the rest stream to the end)
    long_chars: int = 6000  # a long prompt's characters (~1,500 tokens of Python)
    seed: int = 0

    @property
    def every(self) -> int:
        return self.sample_every or max(1, self.requests // 50)


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # short | long
    mode: str  # one of MODES
    text: str
    bad: str | None = None  # BAD_BODIES key (mode "bad")


@dataclass(frozen=True)
class Sample:
    """The server as /metrics saw it once `requests` requests had ended."""
    requests: int
    seconds: float  # since the run's start
    rss: int | None
    cache_bytes: int | None  # what the prefix cache's blocks hold
    cache_allocated: int | None  # its pool's chunks
    cache_budget: int | None


@dataclass
class SoakRow:
    index: int
    kind: str
    mode: str
    outcome: str  # ok | cancelled | refused (a bad body's 4xx) | error (anything else)
    http_status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    seconds: float = 0.0


@dataclass
class SoakResult:
    target: Target
    settings: LoadSettings
    soak: SoakSettings
    rows: list[SoakRow]
    samples: list[Sample]
    wall_s: float
    notes: dict[str, Any] = field(default_factory=dict)


def long_windows(sources: Sequence[tuple[str, str]], chars: int) -> list[tuple[str, str]]:
    """Every window of `chars` characters starting on the OFFSET_GRID (moved to the next line start) of
    each source: (a name, the text)."""
    out = []
    for name, text in sources:
        for at in range(0, len(text) - chars + 1, OFFSET_GRID):
            start = at if at == 0 else text.find("\n", at) + 1
            if at == 0 or 0 < start <= len(text) - chars:
                out.append((f"{name}@{start}", text[start : start + chars]))
    if not out:
        raise SpecstackError(f"no source file holds {chars} characters: lower --long-chars")
    return out


def soak_plan(s: SoakSettings, shorts: Sequence[str], longs: Sequence[str]) -> list[SoakRequest]:
    """The run's requests, in sending order: each request's kind and mode drawn with the settings' shares
    (seeded), short prompts taken in order and cycling, long windows drawn at random (repeats happen)."""
    if not shorts or not longs:
        raise SpecstackError("the soak needs short and long prompts")
    rng = random.Random(f"soak:{s.seed}")
    plan = []
    short_i = 0
    bad_names = list(BAD_BODIES)
    for i in range(s.requests):
        kind = "long" if rng.random() < s.long_share else "short"
        u = rng.random()
        mode = ("bad" if u < s.bad_share else "cancel" if u < s.bad_share + s.cancel_share
                else "whole" if u < s.bad_share + s.cancel_share + s.whole_share else "stream")
        if kind == "long":
            text = longs[rng.randrange(len(longs))]
        else:
            text, short_i = shorts[short_i % len(shorts)], short_i + 1
        plan.append(SoakRequest(i, kind, mode, text, bad_names[i % len(bad_names)] if mode == "bad" else None))
    return plan


async def _whole(http: httpx.AsyncClient, url: str, body: dict[str, Any], row: SoakRow, timeout: float) -> None:
    try:
        r = await http.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as e:
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:ERROR_CHARS]
        return
    row.http_status = r.status_code
    if r.status_code != 200:
        row.error = error_message(r.content)
        return
    try:
        doc = r.json()
        usage = doc["usage"]
        row.prompt_tokens = usage["prompt_tokens"]
        row.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        doc["choices"][0]["text"]  # noqa: B018 (a body without its text is an error)
    except (ValueError, KeyError, IndexError, TypeError):
        row.error = f"not a completion: {r.text[:80]!r}"
        return
    row.outcome = "ok"


async def _bad(http: httpx.AsyncClient, url: str, body: dict[str, Any] | bytes, row: SoakRow, timeout: float) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body)
    try:
        r = await http.post(url, content=content, headers={"content-type": "application/json"}, timeout=timeout)
    except httpx.HTTPError as e:
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:ERROR_CHARS]
        return
    row.http_status = r.status_code
    if 400 <= r.status_code < 500:
        row.outcome = "refused"
    else:
        row.error = f"a bad body got HTTP {r.status_code}: {error_message(r.content)}"


async def one(http: httpx.AsyncClient, target: Target, s: LoadSettings, req: SoakRequest) -> SoakRow:
    """Send one request of the plan and record how it ended."""
    url = target.url + "/completions"
    row = SoakRow(req.index, req.kind, req.mode, "error")
    t = time.perf_counter()
    body = streamed_body({"prompt": req.text}, target.model, s)
    if req.mode == "bad":
        assert req.bad is not None
        await _bad(http, url, BAD_BODIES[req.bad](target.model, req.text), row, s.timeout)
    elif req.mode == "whole":
        body.pop("stream_options")
        await _whole(http, url, {**body, "stream": False}, row, s.timeout)
    else:
        r = await send(http, url, body, RequestRow("soak", req.index, req.index, "completions"), t, s.timeout,
                       cancel_after=CANCEL_AFTER if req.mode == "cancel" else None)
        row.http_status, row.error = r.http_status, r.error
        row.prompt_tokens, row.cached_tokens = r.prompt_tokens, r.cached_tokens
        row.outcome = r.status if r.status in ("ok", "cancelled") else "error"  # a cancel may end first: ok
    row.seconds = time.perf_counter() - t
    return row


async def sample(http: httpx.AsyncClient, target: Target, done: int, t0: float) -> Sample:
    try:
        r = await http.get(target.root + "/metrics", timeout=30.0)
        text = r.text if r.status_code == 200 else ""
    except httpx.HTTPError:
        text = ""
    return Sample(done, time.perf_counter() - t0, parse_rss(text), gauge(text, "specstack:prefix_cache_bytes"),
                  gauge(text, "specstack:prefix_cache_allocated_bytes"),
                  gauge(text, "specstack:prefix_cache_capacity_bytes"))


def progress_line(s: Sample, total: int, rows: Sequence[SoakRow]) -> str:
    def mb(v: int | None) -> str:
        return "–" if v is None else f"{v / 2**20:,.1f} MB"

    errors = sum(1 for r in rows if r.outcome == "error")
    cache = "" if s.cache_budget is None else f", prefix cache {mb(s.cache_bytes)} of {mb(s.cache_budget)}"
    return f"soak: {s.requests:,}/{total:,} requests, {s.seconds:,.0f} s, server RSS {mb(s.rss)}{cache}, errors {errors}"


async def run_async(url: str, model: str | None, api_key: str | None, s: LoadSettings, soak: SoakSettings,
                    plan: Sequence[SoakRequest], progress: Progress,
                    on_sample: Callable[[SoakResult], None] | None = None) -> SoakResult:
    """Send the plan, `concurrency` in flight; after every sample `on_sample` gets the result so far (the
    files are rewritten as the run goes, so a soak stopped after hours keeps what it measured)."""
    target = Target(url, "", api_key)
    async with client(target, soak.concurrency + 1, s.timeout) as http:
        target = Target(url, await resolve_model(http, url, model, min(s.timeout, 30.0)), api_key)
        t0 = time.perf_counter()
        samples = [await sample(http, target, 0, t0)]
        progress(progress_line(samples[0], len(plan), []))
        rows: list[SoakRow] = []
        todo = iter(plan)
        lock = asyncio.Lock()

        async def worker() -> None:
            for req in todo:  # one iterator shared by the workers: each takes the next request
                rows.append(await one(http, target, s, req))
                n = len(rows)
                if n % soak.every == 0 or n == len(plan):
                    async with lock:  # one sample at a time
                        samples.append(await sample(http, target, n, t0))
                        progress(progress_line(samples[-1], len(plan), rows))
                        if on_sample is not None:
                            on_sample(partial(target, s, soak, rows, samples, time.perf_counter() - t0))
                interrupt.check()

        await asyncio.gather(*(worker() for _ in range(soak.concurrency)))
        if samples[-1].requests != len(rows):
            samples.append(await sample(http, target, len(rows), t0))
    return partial(target, s, soak, rows, samples, time.perf_counter() - t0, done=True)


def partial(target: Target, s: LoadSettings, soak: SoakSettings, rows: Sequence[SoakRow], samples: Sequence[Sample],
            wall_s: float, done: bool = False) -> SoakResult:
    """The result of the requests ended so far (rows by index, samples by count)."""
    return SoakResult(target, s, soak, sorted(rows, key=lambda r: r.index), sorted(samples, key=lambda x: x.requests),
                      wall_s, notes={} if done else {"partial": True})


def run(url: str, model: str | None, api_key: str | None, s: LoadSettings, soak: SoakSettings,
        plan: Sequence[SoakRequest], progress: Progress,
        on_sample: Callable[[SoakResult], None] | None = None) -> SoakResult:
    return asyncio.run(run_async(url, model, api_key, s, soak, plan, progress, on_sample))
