"""The tables `specstack bench` prints from finished runs: `--compare` (two runs' summaries, method by
method), `--ratios` (per-prompt ratios of tokens/s between two methods of one run) and `--phases`
(where each method's time goes, per target forward).
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specstack.bench.report import cell, methods_in, prompt_speedups
from specstack.bench.rows import Row, read_rows
from specstack.errors import SpecstackError
from specstack.files import read_text


def read_summary(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise SpecstackError(f"--compare: {folder} has no summary.json (not a finished `specstack bench` run)")
    try:
        doc = json.loads(read_text(path, "summary file"))
    except json.JSONDecodeError:
        raise SpecstackError(f"--compare: {path} is not valid JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("methods"), dict):
        raise SpecstackError(f"--compare: {path} has no 'methods' table")
    return doc


def _change(a: float | None, b: float | None, spec: str) -> str:
    if a is None and b is None:
        return "–"
    text = f"{cell(a, spec)} → {cell(b, spec)}"
    if a and b is not None:
        text += f" ({100 * (b / a - 1):+.0f} %)"
    return text


def compare(dir1: Path, dir2: Path) -> str:
    """Per method (in either run): tokens/s, mean speed-ups and tau, first run → second run."""
    a, b = read_summary(dir1)["methods"], read_summary(dir2)["methods"]
    lines = [f"Comparing {dir1} → {dir2}", "",
             "| method | tokens/s | mean speed-up vs hf | mean speed-up vs ar | tau | identical to ar |",
             "|---|---|---|---|---|---|"]
    for m in list(a) + [m for m in b if m not in a]:
        x, y = a.get(m, {}), b.get(m, {})
        ident = [None if s.get("identical_rate") is None else 100 * s["identical_rate"] for s in (x, y)]
        lines.append(f"| {m}{'' if m in a else ' (new)'}{'' if m in b else ' (gone)'} | "
                     f"{_change(x.get('tokens_per_s'), y.get('tokens_per_s'), '.1f')} | "
                     f"{_change(x.get('mean_speedup_vs_hf'), y.get('mean_speedup_vs_hf'), '.2f')} | "
                     f"{_change(x.get('mean_speedup_vs_ar'), y.get('mean_speedup_vs_ar'), '.2f')} | "
                     f"{_change(x.get('tau'), y.get('tau'), '.2f')} | "
                     f"{cell(ident[0], '.0f')} → {cell(ident[1], '.0f')} % |")
    return "\n".join(lines)


def ratio_table(folder: Path, pairs: Sequence[str]) -> str:
    """Per-prompt ratios of tokens/s, `A/B` for each pair, over the prompts both methods ran: mean,
    geometric mean, median, range and the prompts A won (the tables of docs/bench-history)."""
    rows = read_rows(folder / "results.jsonl")
    if not rows:
        raise SpecstackError(f"{folder} has no results.jsonl rows")
    lines = ["| | mean | geometric mean | median | min – max | prompts won |", "|---|---:|---:|---:|---:|---:|"]
    methods = methods_in(rows)
    for pair in pairs:
        a, slash, b = pair.rpartition("/")
        if not slash or a not in methods or b not in methods:
            raise SpecstackError(f"--ratios {pair!r}: give METHOD/METHOD with methods of this run: {', '.join(methods)}")
        r = list(prompt_speedups(rows, a, b).values())
        if not r:
            raise SpecstackError(f"--ratios {pair!r}: {a} and {b} share no prompt with a speed > 0 in {folder}")
        geo = math.exp(statistics.mean(math.log(x) for x in r))
        lines.append(f"| {a} / {b} | {statistics.mean(r):.3f} | {geo:.3f} | {statistics.median(r):.3f} | "
                     f"{min(r):.2f} – {max(r):.2f} | {sum(x > 1 for x in r)} |")
    return "\n".join(lines)


def has_phases(row: Row) -> bool:
    """The row times its phases: seconds per phase and the target forwards they divide into."""
    phases, forwards = row.get("phases"), row.get("target_forwards")
    return (isinstance(phases, dict) and bool(phases) and all(isinstance(v, (int, float)) for v in phases.values())
            and isinstance(forwards, int) and forwards > 0)


def phase_table(folder: Path) -> str:
    """Where each method's time goes: milliseconds per target forward (a step) in each phase the
    engine times (draft, target, verify, overhead; decode = the whole decoding loop), the prefill
    per step, and the wall time per step, summed over the run's rows (peers time no phases and are
    left out)."""
    rows = read_rows(folder / "results.jsonl")
    if not rows:
        raise SpecstackError(f"{folder} has no results.jsonl rows")
    order = ("prefill", "draft", "target", "verify", "overhead", "decode")
    body = []
    for m in methods_in(rows):
        mine = [r for r in rows if r["method"] == m and has_phases(r)]
        steps = sum(r["target_forwards"] for r in mine)
        if not steps:
            continue
        ms = {k: 1e3 * sum(r["phases"].get(k, 0.0) for r in mine) / steps for k in order}
        cells = " | ".join(f"{ms[k]:.1f}" if any(k in r["phases"] for r in mine) else "–" for k in order)
        wall = 1e3 * sum(r["seconds"] for r in mine) / steps
        body.append(f"| {m} | {cells} | {wall:.1f} | {sum(r['new_tokens'] for r in mine) / steps:.2f} |")
    if not body:
        raise SpecstackError(f"--phases: no row of {folder} carries phase timings (the phases and target_forwards "
                             "of an engine method)")
    head = ["| method | " + " | ".join(order) + " | wall | tokens per step |", "|---|" + "---:|" * (len(order) + 2)]
    return "\n".join(head + body)
