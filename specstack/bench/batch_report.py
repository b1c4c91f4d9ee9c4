"""The batch-mode report of `specstack bench` (--batch-sizes), from its rows: one summary entry per
method and batch size (`METHOD@bB`), the table of summary.md, and batch_throughput.png.

A batch row is one sequence of one batch (it carries `batch_size`); its `seconds` is the batch's wall
time, so the summary counts each batch once, keyed (method, repeat, batch). An `aggregate` row
(llamacpp-batched) stands for a whole batch. Fields of an entry:
- tokens_per_s: all rows' new tokens / the batches' wall time (total throughput);
- tokens_per_s_with_prefill: the same over prefill and generation both (equal to tokens_per_s for our
  methods and hf, whose wall time holds the prefill; llama-batched-bench times them apart);
- speedup_vs_single_ar: tokens_per_s / that of our single-sequence `ar` rows (the baseline `ar`);
- ms_per_token: per sequence, a batch's wall time / its tokens per row, averaged over the rows;
- tau: the rows' tokens per target forward, averaged; identical_rate: the share of rows equal to the
  prompt decoded alone by single-sequence ar (null when sampling);
- phases: the engine's draft / target / verify / overhead seconds summed over the batches (null for
  peers); steps: engine steps; layouts: steps per attention layout (pad, split); draft_forwards_per_step:
  the draft models' forwards an engine step (one a tree level for all rows drafting in a group; null for
  peers and runs before it was counted).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specstack.bench.figures import pyplot, save_png

Row = dict[str, Any]
PHASES = ("draft", "target", "verify", "overhead")


def is_batch_row(row: Row) -> bool:
    return "batch_size" in row


def _batches(rows: Sequence[Row]) -> list[Row]:
    """One row per batch (the first of it)."""
    seen: dict[tuple[int, int], Row] = {}
    for r in rows:
        seen.setdefault((r["repeat"], r.get("batch", 0)), r)
    return list(seen.values())


def _tokens_per_row(r: Row) -> float:
    return r["new_tokens"] / r["batch_size"] if r.get("aggregate") else r["new_tokens"]


def summarize_batches(rows: Sequence[Row], order: Sequence[str], single_ar: float | None) -> dict[str, dict[str, Any]]:
    """Per `METHOD@bB` in `order` (then any others in row order): the fields of the module doc.
    single_ar: the single-sequence ar's tokens/s (None: no speed-up)."""
    by_method: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    names = [m for m in order if m in by_method] + [m for m in by_method if m not in order]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = by_method[name]
        batches = _batches(mine)
        tokens = sum(r["new_tokens"] for r in mine)
        seconds = sum(r["seconds"] for r in batches)
        with_prefill = sum(r.get("seconds_with_prefill", r["seconds"]) for r in batches)
        tps = tokens / seconds if seconds > 0 else None
        taus = [r["tau"] for r in mine if r.get("tau") is not None]
        checked = [r["identical_to_ar"] for r in mine if r.get("identical_to_ar") is not None]
        timed = [b["batch_phases"] for b in batches if isinstance(b.get("batch_phases"), dict)]
        layouts: dict[str, int] = defaultdict(int)
        for b in batches:
            for k, v in (b.get("batch_layouts") or {}).items():
                layouts[k] += v
        steps = [b["batch_steps"] for b in batches if isinstance(b.get("batch_steps"), int)]
        forwards = [(b["batch_draft_forwards"], b["batch_steps"]) for b in batches
                    if isinstance(b.get("batch_draft_forwards"), int) and b.get("batch_steps")]
        out[name] = {
            "method": mine[0].get("base_method", name), "batch_size": mine[0]["batch_size"],
            "dtype": mine[0].get("dtype"), "prompts": len({r["task_id"] for r in mine if not r.get("aggregate")}),
            "rows": len(mine), "batches": len(batches), "new_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tps,
            "tokens_per_s_with_prefill": tokens / with_prefill if with_prefill > 0 else None,
            "speedup_vs_single_ar": tps / single_ar if tps is not None and single_ar else None,
            "ms_per_token": statistics.mean(1e3 * r["seconds"] / _tokens_per_row(r) for r in mine
                                            if r["new_tokens"] > 0) if any(r["new_tokens"] for r in mine) else None,
            "tau": statistics.mean(taus) if taus else None,
            "identical_rate": sum(checked) / len(checked) if checked else None,
            "phases": {k: sum(p.get(k, 0.0) for p in timed) for k in PHASES} if timed else None,
            "steps": sum(steps) if steps else None,
            "layouts": dict(layouts) or None,
            "draft_forwards_per_step": (sum(f for f, _ in forwards) / sum(n for _, n in forwards)) if forwards else None,
        }
    return out


# ---------------------------------------------------------------------------------------------------
# summary.md
# ---------------------------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def _phases_text(s: Mapping[str, Any]) -> str:
    """Shares of the engine's time: `target 91 %, verify 2 %, ...` (– for peers)."""
    phases = s.get("phases")
    total = sum(phases.values()) if phases else 0
    if not total:
        return "–"
    return ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in phases.items() if v)


def batch_table(summary: Mapping[str, Mapping[str, Any]], single_ar: str | None) -> str:
    base = single_ar or "single ar"
    lines = [f"| method | B | dtype | batches | rows | tokens/s | tokens/s with prefill | x {base} | ms/token per "
             "sequence | tau | identical to ar | engine time | layouts (steps) | draft forwards a step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for m, s in summary.items():
        layouts = ", ".join(f"{k} {v}" for k, v in (s.get("layouts") or {}).items()) or "–"
        lines.append(f"| {m} | {s['batch_size']} | {s['dtype']} | {s['batches']} | {s['rows']} | "
                     f"{_f(s['tokens_per_s'], '.1f')} | {_f(s['tokens_per_s_with_prefill'], '.1f')} | "
                     f"{_f(s['speedup_vs_single_ar'])} | {_f(s['ms_per_token'], '.1f')} | {_f(s['tau'])} | "
                     f"{_f(None if s['identical_rate'] is None else 100 * s['identical_rate'], '.0f', ' %')} | "
                     f"{_phases_text(s)} | {layouts} | {_f(s.get('draft_forwards_per_step'))} |")
    return "\n".join(lines)


def batch_section(summary: Mapping[str, Mapping[str, Any]], single_ar: str | None, sizes: Sequence[int]) -> list[str]:
    """summary.md's lines for the batches."""
    return [
        "", f"## Batches (B = {', '.join(map(str, sizes))})", "",
        "Protocol: for each batch size B the prompt set is cut into batches of B consecutive prompts (the last "
        "filled by wrapping around to the first prompts); every method decodes each batch, the method order "
        "rotated from batch to batch; every row generates exactly max-new-tokens tokens (EOS ignored). "
        "tokens/s: all rows' new tokens over the batches' wall time (prefill included, except llamacpp-batched's: "
        "see the notes); ms/token per sequence: a batch's wall time over its tokens per row; identical to ar: rows "
        f"equal to the prompt decoded alone by our single-sequence ar ({single_ar or 'not run'}); engine time: "
        "shares of the batched engine's phases; figure: batch_throughput.png.",
        "", batch_table(summary, single_ar),
    ]


# ---------------------------------------------------------------------------------------------------
# batch_throughput.png
# ---------------------------------------------------------------------------------------------------
def plot_batch_throughput(summary: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    """Total tokens/s against B (log2 axis), one line per method, prefill included for every method (the
    same work); a method timed without its prefill (llama-batched-bench) also gets a dashed line of that."""
    plt = pyplot()
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in summary.values():
        total = s.get("tokens_per_s_with_prefill") or s.get("tokens_per_s")
        if total:
            lines[s["method"]].append((s["batch_size"], total))
        if s.get("tokens_per_s") and s.get("tokens_per_s_with_prefill") not in (None, s["tokens_per_s"]):
            lines[s["method"] + " (decode only)"].append((s["batch_size"], s["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sizes = sorted({b for pts in lines.values() for b, _ in pts})
    for method, pts in lines.items():
        pts.sort()
        ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", ms=4, label=method,
                linestyle="--" if method.endswith("(decode only)") else "-")
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.minorticks_off()
    ax.set_xlabel("batch size B (sequences decoded at once)")
    ax.set_ylabel("total new tokens/s (prefill included)")
    ax.set_title("Batched decoding throughput")
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
