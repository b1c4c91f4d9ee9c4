"""The numbers of a `specstack bench-serve` level, from its request rows, and the results a run keeps.

Terms (latencies over the level's ok requests, in milliseconds):
- TTFT: from sending a request to its first content chunk; e2e: to the end of its stream; TPOT: (e2e -
  TTFT) / (tokens - 1), the time per output token after the first, comparable across chunkings;
- ITL: the gap between successive content chunks (a speculative server may put several tokens in one
  chunk: `tokens_per_chunk` says how many);
- output tokens: the final `usage.completion_tokens` when the server sends it, else the content chunks;
- throughput counts ok requests only (a cancelled request's tokens are not work the client used).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specstack.bench.serve_settings import Level, LoadSettings, RequestRow, Target


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
