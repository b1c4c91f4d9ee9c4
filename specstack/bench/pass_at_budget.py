"""The scores and the report of `specstack bench --time-budget` (BASS's pass@first / pass@all under a
time budget): sample rows in (time_budget_rows.jsonl), the numbers, time_budget.json, time_budget.md and
pass_at_budget.png out. Nothing here decodes or runs a test: time_budget.py makes the rows.

Terms:
- finish time: seconds from the batch's first step to the end of the step in which the sample
  finished; samples that finish in the same step share it.
- finished within S: finish time <= S.
- pass@first at S (per problem): the first sample to finish within S passes the tests; ties (samples
  of one step) go to the lowest sample index; no sample finished within S: fail.
- pass@all at S (per problem): some sample finished within S passes.
  Overall, each is the share of problems. As functions of S both are steps: pass@first turns on at
  the first finish when that sample passes, pass@all at the first finish of a passing sample (the
  curve of the figure is exact at every finish time).
- tokens/s (a method): all samples' new tokens / the batches' wall times (a batch ends when its last
  sample finishes); median finish: over all samples; median first finish: over problems.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specstack.bench.figures import pyplot, save_png
from specstack.bench.rows import Row
from specstack.files import atomic_write_text

CURVE_POINTS = 200  # evenly spaced budgets of the curve, besides every finish time and given budget
JSON_FILE, MD_FILE, PNG_FILE = "time_budget.json", "time_budget.md", "pass_at_budget.png"


# ---------------------------------------------------------------------------------------------------
# Scoring (pure: rows in, numbers out)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    sample: int
    finish_seconds: float | None  # None: never finished
    passed: bool


def _within(outcomes: Sequence[Outcome], budget: float) -> list[Outcome]:
    return [o for o in outcomes if o.finish_seconds is not None and o.finish_seconds <= budget]


def first_finisher(outcomes: Sequence[Outcome], budget: float = math.inf) -> Outcome | None:
    """The first sample to finish within the budget (ties: the lowest sample index); None if none did."""
    return min(_within(outcomes, budget), key=lambda o: (o.finish_seconds, o.sample), default=None)


def pass_at_first(outcomes: Sequence[Outcome], budget: float) -> bool:
    first = first_finisher(outcomes, budget)
    return first is not None and first.passed


def pass_at_all(outcomes: Sequence[Outcome], budget: float) -> bool:
    return any(o.passed for o in _within(outcomes, budget))


def turn_on(outcomes: Sequence[Outcome]) -> tuple[float | None, float | None]:
    """The least budgets at which pass@first and pass@all hold (None: at no budget)."""
    first = first_finisher(outcomes)
    passing = [o.finish_seconds for o in outcomes if o.passed and o.finish_seconds is not None]
    return (first.finish_seconds if first is not None and first.passed else None), min(passing, default=None)


def rates(times: Sequence[float | None], problems: int, budgets: Sequence[float]) -> list[float]:
    """The share of `problems` whose turn-on time is within each budget."""
    on = sorted(t for t in times if t is not None)
    return [bisect.bisect_right(on, b) / problems if problems else 0.0 for b in budgets]


def outcomes_of(rows: Sequence[Row]) -> dict[str, dict[str, list[Outcome]]]:
    """method -> task -> its samples' outcomes, in row order."""
    out: dict[str, dict[str, list[Outcome]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[r["method"]][r["task_id"]].append(Outcome(r["sample"], r.get("finish_seconds"), bool(r["passed"])))
    return out


def budget_key(b: float) -> str:
    return format(b, "g")


def curve_budgets(rows: Sequence[Row], budgets: Sequence[float]) -> list[float]:
    """A fine grid from 0 past the last finish and the largest given budget: evenly spaced points,
    every finish time (where the curves step) and the given budgets."""
    times = [r["finish_seconds"] for r in rows if r.get("finish_seconds") is not None]
    top = max([*times, *budgets, 1e-3]) * 1.05
    grid = {top * i / (CURVE_POINTS - 1) for i in range(CURVE_POINTS)}
    return sorted(grid | set(times) | set(budgets))


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: Sequence[Row], budgets: Sequence[float], order: Sequence[str] = ()) -> dict[str, Any]:
    """`methods` (per method: speed and pass rates at every budget), `problems` (per problem and
    method) and `curve` (pass rates on curve_budgets), from the rows."""
    by = outcomes_of(rows)
    names = [m for m in order if m in by] + [m for m in by if m not in order]
    grid = curve_budgets(rows, budgets)
    methods: dict[str, Any] = {}
    problems: dict[str, dict[str, Any]] = defaultdict(dict)
    curve: dict[str, Any] = {"budgets": grid, "methods": {}}
    for name in names:
        mine = [r for r in rows if r["method"] == name]
        tasks = by[name]
        ons = {t: turn_on(o) for t, o in tasks.items()}
        walls = {r["task_id"]: r["batch_seconds"] for r in mine if r.get("batch_seconds") is not None}
        tokens = sum(r["new_tokens"] for r in mine)
        firsts = [f.finish_seconds for o in tasks.values() if (f := first_finisher(o)) is not None]
        taus = [r["tau"] for r in mine if r.get("tau") is not None]
        p = len(tasks)
        methods[name] = {
            "problems": p, "samples": len(mine), "new_tokens": tokens, "seconds": sum(walls.values()) or None,
            "tokens_per_s": tokens / sum(walls.values()) if walls and sum(walls.values()) > 0 else None,
            "median_finish_seconds": _median([r["finish_seconds"] for r in mine if r.get("finish_seconds") is not None]),
            "median_first_finish_seconds": _median(firsts),
            "tau": statistics.mean(taus) if taus else None,
            "finish_reasons": dict(Counter(r.get("finish_reason") for r in mine if r.get("finish_reason"))),
            "sample_pass_rate": sum(bool(r["passed"]) for r in mine) / len(mine) if mine else None,
            "pass_at_first": dict(zip(map(budget_key, budgets), rates([a for a, _ in ons.values()], p, budgets),
                                      strict=True)),
            "pass_at_all": dict(zip(map(budget_key, budgets), rates([b for _, b in ons.values()], p, budgets),
                                    strict=True)),
            "pass_at_first_unbounded": rates([a for a, _ in ons.values()], p, [math.inf])[0],
            "pass_at_all_unbounded": rates([b for _, b in ons.values()], p, [math.inf])[0],
        }
        curve["methods"][name] = {"pass_at_first": rates([a for a, _ in ons.values()], p, grid),
                                  "pass_at_all": rates([b for _, b in ons.values()], p, grid)}
        for task, outs in tasks.items():
            first = first_finisher(outs)
            problems[task][name] = {
                "samples": len(outs), "samples_passed": sum(o.passed for o in outs),
                "first_finish_seconds": first.finish_seconds if first else None,
                "first_sample": first.sample if first else None,
                "pass_at_first": {budget_key(b): pass_at_first(outs, b) for b in budgets},
                "pass_at_all": {budget_key(b): pass_at_all(outs, b) for b in budgets},
            }
    return {"budgets": list(budgets), "methods": methods, "problems": dict(problems), "curve": curve}


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f} %"


def render_md(doc: Mapping[str, Any]) -> str:
    s, summary = doc["settings"], doc["summary"]
    budgets = [budget_key(b) for b in summary["budgets"]]
    sampling = "greedy" if s["temperature"] == 0 else (f"temperature {s['temperature']:g}, top-k {s['top_k']}, "
                                                       f"top-p {s['top_p']:g}, seed {s['seed']}")
    lines = [f"# pass@first / pass@all under a time budget: {s['model']} ({s['dtype']}), HumanEval", "",
             f"{len(summary['problems'])} problems, n = {s['n']} samples per problem in one batch, {sampling}, "
             f"at most {s['max_new_tokens']} new tokens; budgets {', '.join(b + ' s' for b in budgets)}. "
             f"Machine: {doc['machine']['cpu']}, {doc['machine']['threads']} threads.", ""]
    head = ["method", "tokens/s", "median finish (s)", "median first finish (s)"]
    head += [f"pass@first {b} s" for b in budgets] + [f"pass@all {b} s" for b in budgets]
    head += ["pass@first (no budget)", "pass@all (no budget)", "samples passing"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in summary["methods"].items():
        cells = [f"`{name}`", _f(m["tokens_per_s"], ".1f"), _f(m["median_finish_seconds"]),
                 _f(m["median_first_finish_seconds"])]
        cells += [_pct(m["pass_at_first"][b]) for b in budgets] + [_pct(m["pass_at_all"][b]) for b in budgets]
        cells += [_pct(m["pass_at_first_unbounded"]), _pct(m["pass_at_all_unbounded"]), _pct(m["sample_pass_rate"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Per problem", "",
              "first / all: pass@first / pass@all at each budget (✓ pass, · fail); first finish: seconds to the "
              "first sample's end, and which sample.", ""]
    head = ["task", "method", "first finish (s)", "passing samples"] + [f"{b} s first / all" for b in budgets]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mark = {True: "✓", False: "·"}
    for task, per in summary["problems"].items():
        for name, p in per.items():
            first = "–" if p["first_finish_seconds"] is None else f"{p['first_finish_seconds']:.2f} (#{p['first_sample']})"
            cells = [task, f"`{name}`", first, f"{p['samples_passed']}/{p['samples']}"]
            cells += [f"{mark[p['pass_at_first'][b]]} / {mark[p['pass_at_all'][b]]}" for b in budgets]
            lines.append("| " + " | ".join(cells) + " |")
    if doc.get("notes"):
        lines += ["", "Notes:", *[f"- {n}" for n in doc["notes"]]]
    lines += ["", f"Command: `{doc['command']}`", ""]
    return "\n".join(lines)


def plot_pass_at_budget(summary: Mapping[str, Any], n: int, path: Path) -> None:
    """The paper's figure: pass@first and pass@all against the budget, one line per method, the given
    budgets marked."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    grid = summary["curve"]["budgets"]
    for ax, key, title in zip(axes, ("pass_at_first", "pass_at_all"), ("pass@first", "pass@all"), strict=True):
        for name, c in summary["curve"]["methods"].items():
            ax.plot(grid, [100 * v for v in c[key]], drawstyle="steps-post", label=name)
        for b in summary["budgets"]:
            ax.axvline(b, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{title} (n = {n})")
        ax.set_xlabel("time budget (s)")
        ax.set_xlim(0, grid[-1] if grid else 1)
        ax.set_ylim(-2, 102)  # a line at 0 % or 100 % stays visible
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("problems solved (%)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_report(out: Path, rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    """time_budget.json, .md and pass_at_budget.png from the rows; returns the json's content."""
    s = meta["settings"]
    doc = {**meta, "summary": summarize(rows, s["budgets"], s["methods"])}
    atomic_write_text(out / JSON_FILE, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out / MD_FILE, render_md(doc))
    plot_pass_at_budget(doc["summary"], s["n"], out / PNG_FILE)
    return doc
