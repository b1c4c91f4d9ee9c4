"""Predicted against measured (`specstack throughput-check DIR`): for every `chain` method of a finished
greedy `specstack bench` run, the throughput model's multiplier at batch 1 (with the run's own τ and
the pass times of a hardware preset, normally this machine's calibration) beside the speed-up the run
measured over its `ar` in the same weight format.

Measured multiplier, per prompt: seconds per token of `ar`'s decoding (decode time / target forwards:
its first token comes from the prefill) over `chain`'s (decode time / tokens), so the prefill, which
the model leaves out, is left out of both; the median over prompts is reported, because on a shared
machine the load changes between prompts but hardly within one (bench runs the methods of a prompt
back to back). The wall-clock speed-up (prefill included, total over total) is shown beside it. The
run's phase times split a round into draft passes, the verification pass and the rest (verify walk,
commits): the model predicts the first two and ignores the rest, so a miss can be placed. τ is
pooled (total tokens / total rounds). The context is each prompt's length plus half the new tokens,
averaged.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specstack.bench.datasets import iter_prompts
from specstack.bench.plan import parse_methods
from specstack.bench.rows import read_rows, read_run
from specstack.errors import SpecstackError
from specstack.models.drafts import choose_draft
from specstack.models.loading import load_tokenizer
from specstack.models.registry import resolve
from specstack.prompts import encode_prompt
from specstack.throughput.model import (
    Conventions,
    Hardware,
    Round,
    round_times,
    vanilla_draft,
)
from specstack.throughput.shapes import ModelShape, draft_shape, from_config, read_config


@dataclass(frozen=True)
class Run:
    """One method's rows on one prompt, summed over repeats."""

    new_tokens: int
    rounds: int  # target forwards that produced tokens
    seconds: float
    phases: dict[str, float]


def runs(rows: Sequence[dict[str, Any]], method: str) -> dict[str, Run]:
    """task_id -> that method's totals on it."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["method"] == method:
            by_task.setdefault(r["task_id"], []).append(r)
    if not by_task:
        raise SpecstackError(f"the run has no rows of {method!r}")
    out = {}
    for task, mine in by_task.items():
        phases: dict[str, float] = {}
        for r in mine:
            for k, v in (r.get("phases") or {}).items():
                phases[k] = phases.get(k, 0.0) + v
        if "decode" not in phases:
            raise SpecstackError(f"rows of {method!r} carry no phase times: rerun the benchmark with this version")
        out[task] = Run(sum(r["new_tokens"] for r in mine), sum(r["target_forwards"] or 0 for r in mine),
                        sum(r["seconds"] for r in mine), phases)
    return out


@dataclass(frozen=True)
class CheckRow:
    method: str
    k: int
    tau: float
    context: float
    predicted: Round
    prompts: int
    # measured, medians over prompts
    t_target: float  # seconds per ar decoding step
    t_draft_round: float  # draft seconds per round (k passes and their bookkeeping)
    t_verify: float  # target-forward seconds per round
    t_other: float  # verify walk, commit, drafter feedback per round
    measured: float  # decode speed-up
    passes_multiplier: float  # the model's formula on the measured pass times: the miss left is the rest
    wall: float  # wall-clock speed-up, prefill included, total over total

    @property
    def predicted_multiplier(self) -> float:
        return self.predicted.multiplier(self.tau)

    @property
    def error(self) -> float:
        return self.predicted_multiplier / self.measured - 1


def mean_context(settings: dict[str, Any], task_ids: set[str], new_tokens: int) -> float:
    """Each benchmarked prompt's token count plus half the new tokens, averaged."""
    tok = load_tokenizer(resolve(settings["model"]), None)
    lengths = [len(encode_prompt(tok, p.text, chat=p.chat)) for p in iter_prompts(settings["prompts"])
               if p.task_id in task_ids]
    if not lengths:
        raise SpecstackError("none of the run's prompts were found in its prompt set")
    return sum(lengths) / len(lengths) + new_tokens / 2


# The settings of run.json (BenchSettings' fields) this check reads, and the types they must have;
# a missing optional one reads as its default here
SETTINGS: dict[str, tuple[type, ...]] = {
    "model": (str,), "prompts": (str,), "methods": (list,), "dtype": (str,), "max_new_tokens": (int,),
    "temperature": (int, float), "draft": (str, type(None)), "draft_dtype": (str, type(None))}
DEFAULTS: dict[str, object] = {"temperature": 0}


def read_settings(run_dir: Path) -> dict[str, Any]:
    """DIR/run.json (read_run), with the settings this check reads checked: one error names the file
    and every bad setting."""
    settings = read_run(run_dir)
    values = {k: settings.get(k, DEFAULTS.get(k)) for k in SETTINGS}
    bad = [k for k, types in SETTINGS.items() if isinstance(values[k], bool) or not isinstance(values[k], types)]
    if isinstance(values["methods"], list) and not all(isinstance(m, str) for m in values["methods"]):
        bad.append("methods")
    if isinstance(values["max_new_tokens"], int) and values["max_new_tokens"] < 1 and "max_new_tokens" not in bad:
        bad.append("max_new_tokens")
    if bad:
        raise SpecstackError(f"{run_dir / 'run.json'}: not the settings of a `specstack bench` run (missing or "
                             f"malformed: {', '.join(bad)})")
    return settings | values


def check(run_dir: Path, hw: Hardware, conv: Conventions, context: float | None = None) -> tuple[list[CheckRow], str]:
    """Rows for every chain method of the run; also the draft spec the run used."""
    settings = read_settings(run_dir)
    rows = read_rows(run_dir / "results.jsonl")
    if not rows:
        raise SpecstackError(f"{run_dir} has no results")
    if settings.get("temperature", 0) != 0:
        raise SpecstackError("throughput-check compares greedy runs (τ of a sampled run is another quantity)")
    methods = parse_methods(settings["methods"], settings["dtype"])
    chains = [m for m in methods if m.name == "chain"]
    if not chains:
        raise SpecstackError(f"{run_dir} has no chain method to check")
    cfg = read_config(settings["model"])
    draft_spec = str(choose_draft(settings.get("draft"), cfg.n_layers, settings["model"]))
    if context is None:
        context = mean_context(settings, {r["task_id"] for r in rows}, settings["max_new_tokens"])
    out = []
    for m in chains:
        ar = next((a for a in methods if a.name == "ar" and a.dtype == m.dtype), None)
        if ar is None:
            raise SpecstackError(f"{m.label}: the run has no `ar` in {m.dtype} to measure the speed-up against")
        target: ModelShape = from_config(cfg, settings["model"], m.dtype)
        draft = draft_shape(draft_spec, target, settings["draft_dtype"])
        k = m.spec.params["k"]
        base, spec = runs(rows, ar.label), runs(rows, m.label)
        tasks = [t for t in spec if t in base]
        if not tasks:
            raise SpecstackError(f"{m.label} and {ar.label} share no prompt")
        tau = sum(spec[t].new_tokens for t in tasks) / max(1, sum(spec[t].rounds for t in tasks))
        predicted = round_times(target, vanilla_draft(draft), hw, 1, round(context), k, conv)
        out.append(check_row(m.label, k, tau, context, predicted, [base[t] for t in tasks], [spec[t] for t in tasks]))
    return out, draft_spec


def check_row(method: str, k: int, tau: float, context: float, predicted: Round, base: list[Run], spec: list[Run]
              ) -> CheckRow:
    """One method's row: the prediction beside the measured medians over prompts, `base` (ar) and
    `spec` (the chain) holding the same prompts in the same order."""
    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    t_target = [a.phases["decode"] / max(1, a.rounds) for a in base]
    n = [max(1, c.rounds) for c in spec]
    draft = [c.phases.get("draft", 0.0) / r for c, r in zip(spec, n, strict=True)]
    verify = [c.phases.get("target", 0.0) / r for c, r in zip(spec, n, strict=True)]
    other = [(c.phases.get("verify", 0.0) + c.phases.get("overhead", 0.0)) / r for c, r in zip(spec, n, strict=True)]
    measured = [t / (c.phases["decode"] / c.new_tokens) for t, c in zip(t_target, spec, strict=True)]
    passes = [(c.new_tokens / r) * t / (d + v) for c, r, t, d, v in zip(spec, n, t_target, draft, verify, strict=True)]
    wall = (sum(a.seconds for a in base) / sum(a.new_tokens for a in base)) / \
        (sum(c.seconds for c in spec) / sum(c.new_tokens for c in spec))
    return CheckRow(method, k, tau, context, predicted, len(spec), med(t_target), med(draft), med(verify), med(other),
                    med(measured), med(passes), wall)


def table(rows: Sequence[CheckRow]) -> str:
    ms = 1e3
    header = ("| method | τ | t_target ms (model / run) | k·t_draft ms | t_verify ms | other ms/round (run) "
              "| Δt (model / run) | multiplier: model | from run's passes | measured (decode) | model error "
              "| measured (wall) |")
    # run columns: medians over prompts; the run's Δt is τ / its measured multiplier
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r.predicted
        run_dt = r.tau / r.measured
        lines.append(
            f"| {r.method} | {r.tau:.3f} | {p.t_target * ms:.1f} / {r.t_target * ms:.1f} "
            f"| {p.k * p.t_draft * ms:.1f} / {r.t_draft_round * ms:.1f} | {p.t_verify * ms:.1f} / {r.t_verify * ms:.1f} "
            f"| {r.t_other * ms:.1f} | {p.delta_t:.2f} / {run_dt:.2f} | {r.predicted_multiplier:.3f} "
            f"| {r.passes_multiplier:.3f} | {r.measured:.3f} | {r.error:+.1%} | {r.wall:.3f} |")
    return "\n".join(lines)
