"""The report of a prefix-cache workload of `specstack bench-serve` (issue 33): WORKLOAD.json (the command,
the machine, the settings, the summary, every request's row) and WORKLOAD.md (the summary's table, also
printed), each written whole. The tables take an optional label column, so that
benchmarks/prefix_cache/compare.py puts several servers' runs in one table.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench.serve_report import machine
from specstack.bench.serve_sessions import WorkloadResult
from specstack.bench.serve_workload_stats import chat_summary, editor_summary, probe_summary
from specstack.bench.serve_workloads import ChatSettings
from specstack.files import atomic_write_text

Summary = Mapping[str, Any]


def summarize(result: WorkloadResult) -> dict[str, Any]:
    if result.workload == "chat":
        ws = result.workload_settings
        turns = ws.turns if isinstance(ws, ChatSettings) else max((r.step for r in result.rows), default=0)
        return chat_summary(result.rows, turns, result.wall_s)
    if result.workload == "editor":
        return editor_summary(result.rows, result.wall_s)
    return probe_summary(result.rows)


def workload_document(result: WorkloadResult, command: str, label: str) -> dict[str, Any]:
    """WORKLOAD.json's content."""
    s = result.settings
    return {
        "command": command, "label": label, "workload": result.workload, "machine": machine(),
        "settings": {"url": result.target.url, "model": result.target.model, "max_tokens": s.max_tokens,
                     "temperature": s.temperature, "ignore_eos": s.ignore_eos, "timeout": s.timeout,
                     "extra_body": dict(s.extra_body), "workload": asdict(result.workload_settings)},
        "check_request": result.check,
        "server_rss_bytes": {"before": result.rss_before, "after": result.rss_after},
        "summary": summarize(result),
        "notes": result.notes,
        "rows": [r.as_dict() for r in result.rows],
    }


# ---------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".0f") -> str:
    return "–" if v is None else format(v, spec)


def _share(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f} %"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], label: str | None) -> str:
    if label is not None:
        head = ["server", *head]
        rows = [[label, *r] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


_REQUEST_HEAD = ["requests", "ok", "err", "TTFT p50", "TTFT p90", "latency p50", "latency p90", "prompt tok/req",
                 "cached tok/req", "cached share"]


def _request_cells(n: Summary) -> list[str]:
    return [str(n["requests"]), str(n["ok"]), str(n["errors"]), _f(n["ttft_ms_p50"]), _f(n["ttft_ms_p90"]),
            _f(n["latency_ms_p50"]), _f(n["latency_ms_p90"]), _f(n["prompt_tokens_mean"]),
            _f(n.get("cached_tokens_mean")), _share(n["cached_share"])]


def chat_table(summary: Summary, label: str | None = None) -> str:
    """One row per turn number, then all turns."""
    rows = [[str(t["turn"]), *_request_cells(t)] for t in summary["turns"]]
    rows.append(["all", *_request_cells(summary["total"])])
    return _table(["turn", *_REQUEST_HEAD], rows, label)


def editor_table(summary: Summary, label: str | None = None) -> str:
    """All requests, the first (cold everywhere), the rest."""
    rows = [[part, *_request_cells(summary[part])] for part in ("all", "first", "rest")]
    return _table(["requests of", *_REQUEST_HEAD], rows, label)


def probe_table(summary: Summary, label: str | None = None) -> str:
    """One row per repeat, then the medians."""
    head = ["repeat", "file", "cold TTFT", "cold tokens", "+tail TTFT", "+tail cached", "+tail / cold", "n file",
            "n=1 TTFT", "n=N TTFT", "N / 1", "choices"]
    rows = [[str(r["repeat"] + 1), str(r["source"]), _f(r["cold_ttft_ms"]), _f(r["cold_prompt_tokens"]),
             _f(r["extended_ttft_ms"]), _f(r["extended_cached_tokens"]), _f(r["extended_over_cold"], ".2f"),
             str(r["n_source"]), _f(r["n1_ttft_ms"]), _f(r["nN_ttft_ms"]), _f(r["nN_over_n1"], ".2f"),
             _f(r["nN_choices"])] for r in summary["repeats"]]
    m = summary["median"]
    rows.append(["median", "", _f(m["cold_ttft_ms"]), "", _f(m["extended_ttft_ms"]), "",
                 _f(m["extended_over_cold"], ".2f"), "", _f(m["n1_ttft_ms"]), _f(m["nN_ttft_ms"]),
                 _f(m["nN_over_n1"], ".2f"), ""])
    return _table(head, rows, label)


TABLES: dict[str, Callable[[Summary, str | None], str]] = {
    "chat": chat_table, "editor": editor_table, "prefix-probe": probe_table}

_EXPLAIN = {
    "chat": "Turn t sends the whole conversation so far (the user's turns and the server's own answers); TTFT "
            "and latency in ms over ok requests; prompt and cached tokens per request (cached: the prompt tokens "
            "the server says it reused; share: of the prompt tokens). Turn 1 may find a chat template's header "
            "cached (the check request before the run has it too).",
    "editor": "Each request: the file's text before the cursor (a window whose start moves in jumps of "
              "--anchor-chars), the cursor moving --step-chars per request; TTFT and latency in ms over ok "
              "requests; prompt and cached tokens per request. The first request is cold on any server.",
    "prefix-probe": "(a) a long prompt sent cold, then the same prompt plus a short tail (+tail / cold: 1 without a "
                    "prefix cache, near tail/prompt with one); (b) n=N samples of a prompt against n=1 of the same "
                    "text on a fresh prefix (N / 1: near 1 when the samples share one prefill). TTFT in ms; "
                    "choices: the choices the n=N stream carried.",
}


def _cached_note(doc: Mapping[str, Any]) -> str:
    ok = [r for r in doc["rows"] if r["status"] == "ok"]
    told = sum(r["cached_tokens"] is not None for r in ok)
    if not told:
        return "The server reported no cached tokens (counted as 0)."
    return f"Cached tokens reported by {told} of {len(ok)} ok requests (the rest counted as 0)."


def render_md(doc: Mapping[str, Any]) -> str:
    s = doc["settings"]
    m = doc["machine"]
    ws = ", ".join(f"{k} {v}" for k, v in s["workload"].items() if v is not None)
    wall = doc["summary"].get("wall_s")
    lines = [f"# bench-serve {doc['workload']}: {doc['label']}", "", f"`{doc['command']}`", "",
             f"Model `{s['model']}` at {s['url']}; {ws}; max_tokens {s['max_tokens']}, temperature "
             f"{s['temperature']:g}{', ignore_eos' if s['ignore_eos'] else ''}; {m['cpu']} ({m['cores']} cores), "
             f"{m['date']}." + (f" Wall time {wall:.1f} s." if wall is not None else ""), "",
             TABLES[doc["workload"]](doc["summary"], None), "",
             _EXPLAIN[doc["workload"]] + " " + _cached_note(doc)]
    return "\n".join(lines) + "\n"


def write_workload(out: Path, doc: Mapping[str, Any]) -> list[Path]:
    """WORKLOAD.json and WORKLOAD.md in `out` (created); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{doc['workload']}.json", out / f"{doc['workload']}.md"]
    atomic_write_text(written[0], json.dumps(doc, indent=1) + "\n")
    atomic_write_text(written[1], render_md(doc))
    return written
