"""The numbers of the prefix-cache workloads of `specstack bench-serve` (issue 33), from their rows.

Latencies are over ok requests, in milliseconds (TTFT: sending to the first content chunk; latency:
sending to the end of the stream); percentiles as serve_stats.percentile. Cached tokens are what the
server says it reused (`usage.prompt_tokens_details.cached_tokens`, or llama.cpp's `timings.cache_n`);
a server that says nothing counts 0, and `cached_reported` tells how many requests said anything, so
"0 cached" and "not reported" stay apart. `cached_share` is cached over prompt tokens, over the ok
requests that reported both.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from specstack.bench.serve_stats import percentile
from specstack.bench.serve_workloads import WorkloadRow


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else 1e3 * p


def _ok(rows: Sequence[WorkloadRow]) -> list[WorkloadRow]:
    return [r for r in rows if r.request.status == "ok"]


def request_numbers(rows: Sequence[WorkloadRow]) -> dict[str, Any]:
    """Counts, TTFT and latency p50/p90, and the prompt and cached tokens of a set of requests."""
    ok = _ok(rows)
    ttft = [r.request.ttft_s for r in ok if r.request.ttft_s is not None]
    e2e = [r.request.e2e_s for r in ok if r.request.e2e_s is not None]
    prompt = [r.request.prompt_tokens for r in ok if r.request.prompt_tokens is not None]
    both = [r.request for r in ok if r.request.prompt_tokens is not None and r.request.cached_tokens is not None]
    both_prompt = sum(q.prompt_tokens or 0 for q in both)
    return {
        "requests": len(rows), "ok": len(ok), "errors": sum(r.request.status == "error" for r in rows),
        "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p90": _ms(ttft, 90),
        "latency_ms_p50": _ms(e2e, 50), "latency_ms_p90": _ms(e2e, 90),
        "prompt_tokens_mean": statistics.fmean(prompt) if prompt else None,
        "prompt_tokens": sum(prompt), "cached_tokens": sum(r.request.cached_tokens or 0 for r in ok),
        "cached_tokens_mean": statistics.fmean(r.request.cached_tokens or 0 for r in ok) if ok else None,
        "cached_reported": sum(r.request.cached_tokens is not None for r in ok),
        "cached_share": sum(q.cached_tokens or 0 for q in both) / both_prompt if both_prompt else None,
    }


def chat_summary(rows: Sequence[WorkloadRow], turns: int, wall_s: float) -> dict[str, Any]:
    """Per turn number 1..turns and over all turns; conversations whose every turn ended ok."""
    groups = {r.group for r in rows}
    complete = sum(1 for g in groups if sum(r.group == g and r.request.status == "ok" for r in rows) == turns)
    return {
        "wall_s": wall_s, "conversations": len(groups), "complete_conversations": complete,
        "turns": [{"turn": t, **request_numbers([r for r in rows if r.step == t])} for t in range(1, turns + 1)],
        "total": request_numbers(rows),
    }


def editor_summary(rows: Sequence[WorkloadRow], wall_s: float) -> dict[str, Any]:
    """All requests, the first (its prompt is cold on any server) and the rest apart."""
    first = [r for r in rows if r.step == 0]
    return {"wall_s": wall_s, "all": request_numbers(rows), "first": request_numbers(first),
            "rest": request_numbers([r for r in rows if r.step != 0])}


def _one(rows: Sequence[WorkloadRow], kind: str) -> WorkloadRow | None:
    return next((r for r in rows if r.kind == kind), None)


def _ttft(r: WorkloadRow | None) -> float | None:
    return 1e3 * r.request.ttft_s if r and r.request.status == "ok" and r.request.ttft_s is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def probe_summary(rows: Sequence[WorkloadRow]) -> dict[str, Any]:
    """Per repeat: (a) cold and extended TTFT, extended / cold, their prompt and cached tokens; (b) the
    n1 and nN TTFT, nN / n1, and how many choices the nN stream carried; then the medians over repeats."""
    repeats = []
    for g in sorted({r.group for r in rows}):
        mine = [r for r in rows if r.group == g]
        cold, ext, n1, nn = (_one(mine, k) for k in ("cold", "extended", "n1", "nN"))
        item: dict[str, Any] = {"repeat": g, "source": cold.source if cold else None,
                                "n_source": n1.source if n1 else None}
        for name, r in (("cold", cold), ("extended", ext), ("n1", n1), ("nN", nn)):
            item[f"{name}_ttft_ms"] = _ttft(r)
            item[f"{name}_prompt_tokens"] = r.request.prompt_tokens if r else None
            item[f"{name}_cached_tokens"] = r.request.cached_tokens if r else None
            item[f"{name}_status"] = r.request.status if r else "not sent"
        item["extended_over_cold"] = _ratio(item["extended_ttft_ms"], item["cold_ttft_ms"])
        item["nN_over_n1"] = _ratio(item["nN_ttft_ms"], item["n1_ttft_ms"])
        item["nN_choices"] = nn.request.choices if nn else None
        repeats.append(item)
    keys = ("cold_ttft_ms", "extended_ttft_ms", "extended_over_cold", "n1_ttft_ms", "nN_ttft_ms", "nN_over_n1")
    return {"repeats": repeats, "median": {k: _median([item[k] for item in repeats]) for k in keys}}
