"""The report of `specstack bench-serve` (and of benchmarks/serve_peers.py): serve.json, the markdown
table of serve.md (one row per level), and serve.png (total tokens/s and p50/p99 inter-token latency
against the load), each written whole (specstack.files).

serve.json holds the command line, the machine, the settings, the server's resident memory before and
after, one summary per level (serve_stats.summarize_level's fields plus `consistency`), the consistency
over the whole run, and every request's row (times in seconds, its text).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench.figures import pyplot, save_png
from specstack.bench.serve_stats import RunResult, consistency, row_dict
from specstack.files import atomic_write_text
from specstack.machine import cpu_model, now, package_version, versions
from specstack.validate import available_cores

Summary = Mapping[str, Any]


def machine() -> dict[str, Any]:
    """Where the client ran (the server's machine is the same one in every run of serve_peers.py)."""
    return {"cpu": cpu_model(), "cores": available_cores(), "date": now(),
            "versions": {**versions(), "httpx": package_version("httpx")}}


def run_document(result: RunResult, command: str, label: str, prompt_set: str) -> dict[str, Any]:
    """serve.json's content."""
    s = result.settings
    return {
        "command": command, "label": label, "machine": machine(),
        "settings": {"url": result.target.url, "model": result.target.model, "prompts": prompt_set,
                     "levels": [lr.level.name for lr in result.levels], **asdict(s),
                     "extra_body": dict(s.extra_body)},
        "check_request": result.check,
        "server_rss_bytes": {"before": result.rss_before,
                             "after": result.levels[-1].rss_after if result.levels else None},
        "levels": [lr.summary(result.greedy) for lr in result.levels],
        "consistency": consistency(result.rows()) if result.greedy else None,
        "rows": [row_dict(r) for r in result.rows()],
    }


# ---------------------------------------------------------------------------------------------------
# serve.md
# ---------------------------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def _mismatches(s: Summary) -> str:
    c = s.get("consistency")
    return "–" if c is None else str(c["mismatched"])


def level_table(levels: Sequence[Summary], label: str | None = None) -> str:
    """One row per level; latencies in ms. With `label`, a first column names the server (serve_peers)."""
    head = ("| level | ok | err | cancelled | wall s | tokens/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
            "e2e p50 | e2e p99 | TPOT p50 | tokens/chunk | mismatched prompts |")
    rule = "|---|" + "---:|" * 15
    if label is not None:
        head, rule = "| server " + head, "|---" + rule
    lines = [head, rule]
    for s in levels:
        cells = [s["level"], s["ok"], s["errors"], s["cancelled"], _f(s["wall_s"]), _f(s["tokens_per_s"]),
                 _f(s["requests_per_s"], ".2f"), _f(s["ttft_ms_p50"], ".0f"), _f(s["ttft_ms_p99"], ".0f"),
                 _f(s["itl_ms_p50"], ".0f"), _f(s["itl_ms_p99"], ".0f"), _f(s["e2e_ms_p50"], ".0f"),
                 _f(s["e2e_ms_p99"], ".0f"), _f(s["tpot_ms_p50"], ".0f"), _f(s["tokens_per_chunk"], ".2f"),
                 _mismatches(s)]
        if label is not None:
            cells.insert(0, label)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _mib(v: int | None) -> str:
    return "–" if v is None else f"{v / 2**20:.0f} MiB"


def render_md(doc: Mapping[str, Any]) -> str:
    s = doc["settings"]
    lines = [f"# bench-serve: {doc['label']}", "",
             f"`{doc['command']}`", "",
             f"Model `{s['model']}` at {s['url']}; prompts {s['prompts']}, max_tokens {s['max_tokens']}, temperature "
             f"{s['temperature']:g}{', ignore_eos' if s['ignore_eos'] else ''}; {doc['machine']['cpu']} "
             f"({doc['machine']['cores']} cores), {doc['machine']['date']}.", "",
             level_table(doc["levels"]), "",
             "Latencies in ms over ok requests; ITL is per content chunk (a speculative server may send several "
             "tokens in one: tokens/chunk), TPOT per output token after the first; tokens/s counts ok requests' "
             "tokens over the level's wall time."]
    c = doc.get("consistency")
    if c is not None:
        listed = f": prompts {c['mismatched_prompts']}" if c["mismatched"] else ""
        lines += ["", f"Consistency (temperature 0, all levels): {c['mismatched']} of {c['prompts_checked']} prompts "
                      f"got differing texts{listed}."]
    rss = doc.get("server_rss_bytes") or {}
    if rss.get("before") is not None or rss.get("after") is not None:
        lines += ["", f"Server resident memory: {_mib(rss.get('before'))} before, {_mib(rss.get('after'))} after."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# serve.png
# ---------------------------------------------------------------------------------------------------
def plot_levels(series: Mapping[str, Sequence[Summary]], path: Path, title: str = "Serving throughput") -> None:
    """Left: total tokens/s against the load, one line per series (server); right: ITL p50 (solid) and
    p99 (dashed). The x axis is log2 for concurrency levels, linear for rates."""
    plt = pyplot()
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.5))
    kinds = {s["kind"] for levels in series.values() for s in levels}
    xs = sorted({s["value"] for levels in series.values() for s in levels})
    for i, (name, levels) in enumerate(series.items()):
        color = f"C{i % 10}"
        pts = sorted((s["value"], s) for s in levels)
        x = [v for v, _ in pts]
        ax_t.plot(x, [s["tokens_per_s"] for _, s in pts], marker="o", ms=4, color=color, label=name)
        ax_l.plot(x, [s["itl_ms_p50"] for _, s in pts], marker="o", ms=4, color=color, label=f"{name} p50")
        ax_l.plot(x, [s["itl_ms_p99"] for _, s in pts], marker="x", ms=4, color=color, linestyle="--",
                  label=f"{name} p99")
    xlabel = "concurrent requests" if kinds == {"concurrency"} else "requests/s offered (Poisson)"
    for ax in (ax_t, ax_l):
        if kinds == {"concurrency"}:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{v:g}" for v in xs])
            ax.minorticks_off()
        ax.set_xlabel(xlabel)
        if ax.lines:
            ax.legend(fontsize=8)
    ax_t.set_ylabel("total output tokens/s")
    ax_t.set_title(title)
    ax_l.set_ylabel("inter-token latency per chunk (ms)")
    ax_l.set_title("ITL p50 / p99")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_run(out: Path, doc: Mapping[str, Any]) -> list[Path]:
    """serve.json, serve.md and serve.png in `out` (created); the paths written. Without matplotlib
    there is no figure (the numbers are all in the other two)."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "serve.json", out / "serve.md"]
    atomic_write_text(written[0], json.dumps(doc, indent=1) + "\n")
    atomic_write_text(written[1], render_md(doc))
    try:
        plot_levels({doc["label"]: doc["levels"]}, out / "serve.png", f"Serving throughput: {doc['label']}")
    except ImportError:
        return written
    return [*written, out / "serve.png"]
