"""Running the prefix-cache workloads of `specstack bench-serve` (issue 33) against any OpenAI-compatible
endpoint: what to send is serve_workloads.py's, each request is sent and read by serve_load.send (the
same streamed requests, the same TTFT), and every request becomes a `WorkloadRow` (what it was within its
workload, and its RequestRow).

As the level load, a run first resolves the model (GET /models), reads the server's memory, and sends
one short check request (not measured: it also warms the server up, and the texts it shares with the
workload are at most a chat template's header). Then:
- chat: `concurrency` conversations in flight, each sending its next turn when the answer to its last
  one has ended (the next turn holds that answer); a turn that fails ends its conversation;
- editor and prefix-probe: one request at a time, in order (one user typing; probes that must not
  overlap with each other).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from specstack import interrupt
from specstack.bench.datasets import Prompt
from specstack.bench.serve_load import check_request, client, resolve_model, send, server_rss, wait_all
from specstack.bench.serve_settings import LoadSettings, RequestRow, Target
from specstack.bench.serve_sources import Conversation
from specstack.bench.serve_wire import path_of, streamed_body
from specstack.bench.serve_workloads import (
    ChatSettings,
    EditorSettings,
    EditorWindow,
    ProbePrompt,
    ProbeSettings,
    WorkloadRow,
    chat_messages,
    message_chars,
)

WORKLOADS = ("chat", "editor", "prefix-probe")
CHECK_TEXT = "Hello!"  # the check request's prompt: short, and no workload's text starts with it
Progress = Callable[[str], None]
WorkloadSettings = ChatSettings | EditorSettings | ProbeSettings


@dataclass
class WorkloadResult:
    workload: str
    target: Target
    settings: LoadSettings
    workload_settings: WorkloadSettings
    rows: list[WorkloadRow]
    wall_s: float
    rss_before: int | None = None
    rss_after: int | None = None
    check: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)  # the probe's nonce, the sources


def _wall(rows: Sequence[WorkloadRow]) -> float:
    return max((r.request.sent_s + (r.request.e2e_s or 0.0) for r in rows), default=0.0)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{1e3 * v:.0f}"


async def _open(url: str, model: str | None, api_key: str | None, s: LoadSettings) -> tuple[Target, int | None, dict[str, Any]]:
    """The target with its model resolved, the server's memory, the check request's record."""
    target = Target(url, "", api_key)
    async with client(target, 1, s.timeout) as http:
        target = Target(url, await resolve_model(http, url, model, min(s.timeout, 30.0)), api_key)
        rss = await server_rss(http, target.root)
    check = await check_request(target, s, Prompt("check", CHECK_TEXT, chat=s.endpoint == "chat"))
    return target, rss, check


async def _chat(http: httpx.AsyncClient, target: Target, s: LoadSettings, cs: ChatSettings,
                conversations: Sequence[Conversation], rows: list[WorkloadRow], progress: Progress) -> None:
    url = target.url + path_of("chat")
    order = itertools.count()
    queue = iter(enumerate(conversations))
    done = itertools.count(1)
    t0 = time.perf_counter()

    async def conversation() -> None:
        for ci, conv in queue:  # the next conversation not yet taken by another client
            answers: list[str] = []
            mine: list[RequestRow] = []
            for turn in range(1, len(conv.user_turns) + 1):
                interrupt.check()
                messages = chat_messages(conv.user_turns, answers, cs.system)
                req = RequestRow("chat", next(order), ci, "chat")
                rows.append(WorkloadRow("chat", ci, turn, "turn", conv.id, message_chars(messages), req))
                mine.append(req)
                await send(http, url, streamed_body({"messages": messages}, target.model, s), req, t0, s.timeout)
                if req.status != "ok":
                    break  # the next turn would need this answer
                answers.append(req.text)
            ttfts = ", ".join(_ms(r.ttft_s) for r in mine)
            failed = f"; turn {len(mine)} failed: {mine[-1].error}" if mine and mine[-1].status != "ok" else ""
            progress(f"chat: conversation {next(done)}/{len(conversations)} ({conv.id}): TTFT per turn {ttfts} ms"
                     f"{failed}")

    await wait_all([asyncio.create_task(conversation()) for _ in range(min(cs.concurrency, len(conversations)))])


async def _editor(http: httpx.AsyncClient, target: Target, s: LoadSettings, es: EditorSettings,
                  windows: Sequence[EditorWindow], rows: list[WorkloadRow], progress: Progress) -> None:
    url = target.url + path_of("completions")
    t0 = time.perf_counter()
    for i, w in enumerate(windows):
        interrupt.check()
        req = RequestRow("editor", i, 0, "completions")
        rows.append(WorkloadRow("editor", 0, i, "edit", es.source, len(w.text), req))
        await send(http, url, streamed_body({"prompt": w.text}, target.model, s), req, t0, s.timeout)
        if (i + 1) % 10 == 0 or i + 1 == len(windows):
            progress(f"editor: {i + 1}/{len(windows)} requests; the last: cursor {w.cursor}, TTFT {_ms(req.ttft_s)} ms, "
                     f"{req.cached_tokens if req.cached_tokens is not None else '–'} cached of "
                     f"{req.prompt_tokens if req.prompt_tokens is not None else '–'} prompt tokens")


async def _probe(http: httpx.AsyncClient, target: Target, s: LoadSettings, prompts: Sequence[ProbePrompt],
                 rows: list[WorkloadRow], progress: Progress) -> None:
    url = target.url + path_of("completions")
    steps: Counter[int] = Counter()  # requests sent so far per repeat
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        interrupt.check()
        req = RequestRow("prefix-probe", i, p.repeat, "completions")
        rows.append(WorkloadRow("prefix-probe", p.repeat, steps[p.repeat], p.kind, p.source, len(p.text), req))
        steps[p.repeat] += 1
        payload: dict[str, Any] = {"prompt": p.text, **({"n": p.n} if p.n > 1 else {})}
        await send(http, url, streamed_body(payload, target.model, s), req, t0, s.timeout)
        status = "" if req.status == "ok" else f" ({req.status}: {req.error})"
        progress(f"prefix-probe: repeat {p.repeat + 1} {p.kind} ({p.source}, n={p.n}): TTFT {_ms(req.ttft_s)} ms{status}")


async def _run(url: str, model: str | None, api_key: str | None, s: LoadSettings, ws: WorkloadSettings,
               work: Callable[[httpx.AsyncClient, Target, list[WorkloadRow]], Coroutine[Any, Any, None]],
               name: str) -> WorkloadResult:
    target, rss_before, check = await _open(url, model, api_key, s)
    rows: list[WorkloadRow] = []
    connections = ws.concurrency if isinstance(ws, ChatSettings) else 1
    async with client(target, connections, s.timeout) as http:
        await wait_all([asyncio.create_task(work(http, target, rows))])  # polled: a Ctrl-C between requests
        rss_after = await server_rss(http, target.root)
    return WorkloadResult(name, target, s, ws, rows, _wall(rows), rss_before, rss_after, check)


def run_chat(url: str, model: str | None, api_key: str | None, s: LoadSettings, cs: ChatSettings,
             conversations: Sequence[Conversation], progress: Progress) -> WorkloadResult:
    s = replace(s, endpoint="chat")
    result = asyncio.run(_run(url.rstrip("/"), model, api_key, s, cs,
                              lambda http, t, rows: _chat(http, t, s, cs, conversations, rows, progress), "chat"))
    result.notes = {"conversations": [c.id for c in conversations]}
    return result


def run_editor(url: str, model: str | None, api_key: str | None, s: LoadSettings, es: EditorSettings,
               windows: Sequence[EditorWindow], progress: Progress) -> WorkloadResult:
    s = replace(s, endpoint="completions")
    result = asyncio.run(_run(url.rstrip("/"), model, api_key, s, es,
                              lambda http, t, rows: _editor(http, t, s, es, windows, rows, progress), "editor"))
    result.notes = {"source": es.source, "windows": [{"start": w.start, "cursor": w.cursor} for w in windows]}
    return result


def run_probe(url: str, model: str | None, api_key: str | None, s: LoadSettings, ps: ProbeSettings,
              prompts: Sequence[ProbePrompt], progress: Progress) -> WorkloadResult:
    s = replace(s, endpoint="completions")
    result = asyncio.run(_run(url.rstrip("/"), model, api_key, s, ps,
                              lambda http, t, rows: _probe(http, t, s, prompts, rows, progress), "prefix-probe"))
    result.notes = {"sources": list(dict.fromkeys(p.source for p in prompts))}
    return result
