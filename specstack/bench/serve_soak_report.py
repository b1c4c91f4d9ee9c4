"""The soak's numbers and files (`specstack bench-serve --workload soak`, serve_soak.py): the verdict, soak.json,
soak.md and soak.png (the server's memory against requests served), each written whole.

The verdict's growth is the least-squares slope of the server's resident memory against requests ended,
over the samples past a point (the last half of the run; and past `settle` requests, issue 54's goal
being "past the first 2,000"): a slope, not last minus first, so one sample taken while a long prompt
was being read does not decide it. The prefix cache's cost is what /metrics says its pool allocated
(at most its budget by construction) and what its blocks hold; the RSS a cache costs is one soak with it
against one without, on one machine (benchmarks/soak/compare.py draws both).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench.figures import pyplot, save_png
from specstack.bench.serve_report import machine
from specstack.bench.serve_soak import Sample, SoakResult, SoakRow
from specstack.files import atomic_write_text

GOAL_BYTES_PER_REQUEST = 5 * 1024  # issue 54: at most 5 KB a request past the first 2,000
SETTLE = 2000  # requests after which the goal holds (the allocator's and the cache's first fill)


def slope(points: Sequence[tuple[int, int]]) -> float | None:
    """Least-squares bytes per request of (requests, bytes) points; None under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def verdict(samples: Sequence[Sample], rows: Sequence[SoakRow], requests: int) -> dict[str, Any]:
    rss = [(s.requests, s.rss) for s in samples if s.rss is not None]
    settle = min(SETTLE, requests // 2)
    half = slope([p for p in rss if p[0] >= requests // 2])
    after = slope([p for p in rss if p[0] >= settle])
    budgets = [s.cache_budget for s in samples if s.cache_budget is not None]
    allocated = [s.cache_allocated for s in samples if s.cache_allocated is not None]
    held = [s.cache_bytes for s in samples if s.cache_bytes is not None]
    outcomes = Counter(r.outcome for r in rows)
    unexpected = [r for r in rows if r.outcome == "error"]
    return {
        "requests": len(rows),
        "outcomes": dict(outcomes),
        "by_mode": {m: dict(Counter(r.outcome for r in rows if r.mode == m)) for m in sorted({r.mode for r in rows})},
        "errors": [{"index": r.index, "mode": r.mode, "http_status": r.http_status, "error": r.error}
                   for r in unexpected[:20]],
        "cached_tokens": sum(r.cached_tokens or 0 for r in rows if r.outcome == "ok"),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in rows if r.outcome == "ok"),
        "rss_first": rss[0][1] if rss else None,
        "rss_last": rss[-1][1] if rss else None,
        "rss_max": max((y for _, y in rss), default=None),
        "growth_last_half_bytes_per_request": half,
        "settle_requests": settle,
        "growth_after_settle_bytes_per_request": after,
        "goal_bytes_per_request": GOAL_BYTES_PER_REQUEST,
        "flat": None if after is None else after <= GOAL_BYTES_PER_REQUEST,
        "cache_budget": budgets[-1] if budgets else None,
        "cache_allocated_max": max(allocated, default=None),
        "cache_bytes_last": held[-1] if held else None,
        "cache_within_budget": None if not budgets else max(allocated, default=0) <= budgets[-1],
    }


def soak_document(result: SoakResult, command: str, label: str) -> dict[str, Any]:
    """soak.json's content."""
    return {
        "command": command, "label": label, "machine": machine(), "workload": "soak",
        "settings": {"url": result.target.url, "model": result.target.model, **asdict(result.soak),
                     "max_tokens": result.settings.max_tokens, "temperature": result.settings.temperature,
                     "timeout": result.settings.timeout, "extra_body": dict(result.settings.extra_body)},
        "wall_s": result.wall_s,
        "verdict": verdict(result.samples, result.rows, result.soak.requests),
        "samples": [asdict(s) for s in result.samples],
        "rows": [asdict(r) for r in result.rows],
        "notes": result.notes,
    }


def _kb(v: float | None) -> str:
    return "–" if v is None else f"{v / 1024:,.1f} KB"


def _mb(v: float | None) -> str:
    return "–" if v is None else f"{v / 2**20:,.1f} MB"


def verdict_table(v: Mapping[str, Any], label: str | None = None) -> str:
    head = ["server", "requests", "ok / cancelled / refused / errors", "RSS first → last (max)",
            "growth a request, last half", "past the first 2,000 (or half)", "prefix cache: held / pool / budget"]
    o = v["outcomes"]
    cache = "no cache" if v["cache_budget"] is None else \
        f"{_mb(v['cache_bytes_last'])} / {_mb(v['cache_allocated_max'])} / {_mb(v['cache_budget'])}"
    cells = [label or "", f"{v['requests']:,}",
             " / ".join(str(o.get(k, 0)) for k in ("ok", "cancelled", "refused", "error")),
             f"{_mb(v['rss_first'])} → {_mb(v['rss_last'])} ({_mb(v['rss_max'])})",
             _kb(v["growth_last_half_bytes_per_request"]),
             f"{_kb(v['growth_after_settle_bytes_per_request'])} (past {v['settle_requests']:,})", cache]
    if label is None:
        head, cells = head[1:], cells[1:]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"])


def render_md(doc: Mapping[str, Any]) -> str:
    v = doc["verdict"]
    s = doc["settings"]
    flat = {True: f"flat (≤ {_kb(v['goal_bytes_per_request'])} a request past {v['settle_requests']:,})",
            False: f"GROWS (over {_kb(v['goal_bytes_per_request'])} a request past {v['settle_requests']:,})",
            None: "too few samples to say"}[v["flat"]]
    lines = [f"# Soak: {doc['label']}", "", f"`{doc['command']}`", "",
             f"{s['requests']:,} requests, {s['concurrency']} in flight, {doc['wall_s']:,.0f} s; "
             f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores; {doc['machine']['date']}", "",
             verdict_table(v), "", f"Verdict: memory {flat}."]
    if doc["notes"].get("partial"):
        lines[4:4] = [f"**Partial**: the run so far ({v['requests']:,} of {s['requests']:,} requests ended).", ""]
    if v["cache_within_budget"] is False:
        lines.append("The prefix cache's pool went over its budget.")
    if v["errors"]:
        lines += ["", "Errors (first 20):"] + [f"- #{e['index']} {e['mode']}: HTTP {e['http_status']}: {e['error']}"
                                              for e in v["errors"]]
    return "\n".join(lines) + "\n"


def plot_soaks(series: Mapping[str, Mapping[str, Any]], path: Path, title: str = "Server memory under a soak") -> None:
    """Left: the server's RSS against requests ended, one line per run, its prefix cache's pool dotted and
    budget dashed; right: the RSS's growth since the run's first sample past `settle` requests (the
    scale at which a leak shows), with the goal's slope from there as a grey line."""
    plt = pyplot()
    fig, (ax, ax_g) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (name, doc) in enumerate(series.items()):
        color = f"C{i % 10}"
        samples, v = doc["samples"], doc["verdict"]
        pts = [(x["requests"], x["rss"] / 2**20) for x in samples if x["rss"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=f"{name}: server RSS")
        pool = [(x["requests"], x["cache_allocated"] / 2**20) for x in samples if x["cache_allocated"] is not None]
        if pool and v["cache_budget"]:
            ax.plot([p[0] for p in pool], [p[1] for p in pool], color=color, linestyle=":", label=f"{name}: cache pool")
            ax.axhline(v["cache_budget"] / 2**20, color=color, linestyle="--", linewidth=0.7)
        late = [p for p in pts if p[0] >= v["settle_requests"]]
        if late:
            x0, y0 = late[0]
            ax_g.plot([p[0] for p in late], [p[1] - y0 for p in late], color=color, label=name)
            x1 = late[-1][0]
            ax_g.plot([x0, x1], [0, (x1 - x0) * v["goal_bytes_per_request"] / 2**20], color="grey", linewidth=0.8,
                      linestyle="--", label="goal: 5 KB a request" if i == 0 else None)
    ax.set_xlabel("requests ended")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax_g.set_xlabel("requests ended")
    ax_g.set_ylabel("RSS growth since the settled point (MB)")
    ax_g.set_title("Growth past the first requests")
    ax_g.axhline(0, color="black", linewidth=0.5)
    ax_g.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_soak(out: Path, doc: Mapping[str, Any], figure: bool = True) -> list[Path]:
    """soak.json, soak.md and (figure) soak.png in `out` (created); the paths written (no figure without
    matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "soak.json", out / "soak.md"]
    atomic_write_text(written[0], json.dumps(doc, indent=1) + "\n")
    atomic_write_text(written[1], render_md(doc))
    if not figure:
        return written
    try:
        plot_soaks({doc["label"]: doc}, out / "soak.png", f"Server memory under a soak: {doc['label']}")
    except ImportError:
        return written
    return [*written, out / "soak.png"]
