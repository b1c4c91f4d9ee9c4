"""The `specstack bench` run: speculative methods against autoregressive decoding and the peers people
would otherwise use, on a prompt set, on this machine (a checked Plan in, DIR's files out).

Protocol: every model is loaded once and every drafter built once; one warm-up generation per method;
then for each prompt every method in turn (A B C A B C ...), --repeats times. Every method generates
exactly max_new_tokens tokens (EOS does not stop it: equal work, fair tokens/s); wall time includes
the prefill; torch and llama.cpp use the same threads. Greedy runs mark each row `identical_to_ar`:
same tokens as our `ar` at that method's weight format, the reference (run once extra, untimed, when
the list has no such `ar`). Rows go to DIR/results.jsonl as they finish (a resumed run skips those
already there); then summary.json, summary.md, speedup_per_prompt.png, tau_hist.png and origins.html
(report.py).

A runner is one method made ready: (prompt ids, n) -> Output, everything it needs loaded up front.
With --batch-sizes the methods decode batches instead (bench/batched.py has that protocol).
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specstack import interrupt
from specstack.bench.batched import build_batch_methods, measure_batches, single_label
from specstack.bench.datasets import SHAREGPT_MAX_PROMPT_TOKENS, EncodedPrompt, Prompt, iter_prompts, select_prompts
from specstack.bench.outputs import Output, Runner
from specstack.bench.peer_runners import Peers
from specstack.bench.peer_table import PEERS
from specstack.bench.peers import hf_dtype
from specstack.bench.plan import BenchMethod, Plan
from specstack.bench.report import write_report
from specstack.bench.rows import read_rows
from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.base import Drafter
from specstack.drafting.batch_length import BatchLength
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt
from specstack.weight_formats import weight_format

WARMUP_TOKENS = 16


# ---------------------------------------------------------------------------------------------------
# Runners: prompt ids, n -> Output (one per method, everything loaded up front)
# ---------------------------------------------------------------------------------------------------


def run_method(target, drafter, ids, gen, length=None):  # indirection: tests wrap it to count or alter generations
    return generate(target, ids, gen, drafter=drafter, length=length)


def engine_runner(lm: LoadedModel, drafter: Drafter | None, sampling: SamplingParams,
                  length: Callable[[], BatchLength] | None = None) -> Runner:
    """length: a new draft-length rule for each generation (every prompt starts afresh, as its drafter does)."""
    def go(ids: list[int], n: int) -> Output:
        res = run_method(lm, drafter, ids, GenerationConfig(max_new_tokens=n, sampling=sampling, stop_on_eos=False),
                         None if length is None else length())
        st = res.stats
        origins = res.origins
        phases = {"prefill": st.prefill_seconds, "decode": st.decode_seconds}
        if st.steps:
            phases |= st.phase_seconds()
        return Output(res.tokens, lm.fmt, st.target_forwards, st.tau, dict(Counter(origins)), phases,
                      [s.accepted for s in st.steps] if drafter is not None else None,
                      origins if drafter is not None else None)

    return go


@dataclass
class Runners:
    """Every method of a plan made ready, or skipped with the reason; notes for the summary."""

    ready: dict[str, Runner]
    skipped: dict[str, str]
    notes: list[str]
    peers: dict[str, str] = field(default_factory=dict)  # a peer's label -> what ran it (package, version, build)


def build_runners(plan: Plan, targets: dict[str, LoadedModel], peers: Peers, sources: DraftSources,
                  n_ctx: int) -> Runners:
    out = Runners({}, {}, [])
    for m in plan.methods:
        if m.peer:
            why = peers.unavailable(m)
            if why is not None:
                out.skipped[m.label] = why
                print(f"{m.label}: skipped ({why})", file=sys.stderr)
                continue
            if PEERS[m.name].runs == "transformers" and hf_dtype(m.dtype) != m.dtype:
                out.notes.append(f"{m.label}: transformers cannot run {m.dtype} weights: it ran {hf_dtype(m.dtype)}")
            try:
                out.ready[m.label] = peers.runner(m, n_ctx)
            except SpecstackError as e:  # a peer that cannot start is a line of the report, not the run's end
                out.skipped[m.label] = f"failed: {e}"
                print(f"{m.label}: failed ({e}); the run goes on without it", file=sys.stderr)
                continue
            out.peers[m.label] = peers.about[m.label]
        else:
            target = targets[m.dtype]
            drafter = build_drafter(m.spec, target, sources, plan.settings.device)
            out.ready[m.label] = engine_runner(target, drafter, plan.settings.sampling,
                                               lambda t=target, sp=m.spec: length_rule(sp, t, 1))
    out.notes += tie_notes(plan)
    return out


def tie_notes(plan: Plan) -> list[str]:
    """Why a lossless method can differ from ar in a non-fp32 format (greedy runs with such a method)."""
    if not (plan.settings.sampling.greedy and any(not m.peer and weight_format(m.dtype).activation == "bf16" for m in plan.methods)):
        return []
    return ["identical to ar: the int4/int8/bf16 formats compute in bf16, where the top logits often "
                         "tie or nearly tie and forwards of different widths can break a tie differently, so a "
                         "lossless method can still differ from ar there (DESIGN §2.1); fp32 runs compare exactly"]


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def _meta(plan: Plan, runners: Runners, threads: int, command: str) -> dict[str, Any]:
    ars = [m for m in plan.methods if m.name == "ar"]
    ar = next((m for m in ars if m.dtype == plan.settings.dtype), ars[0] if ars else None)
    hf = next((m for m in plan.methods if m.name == "hf"), None)
    return {"baselines": {"ar": ar and ar.label, "hf": hf and hf.label}, "skipped": runners.skipped,
            "notes": runners.notes, "peers": runners.peers, "settings": asdict(plan.settings),
            "machine": {"cpu": cpu_model(), "threads": threads}, "versions": versions(), "command": command,
            "date": now()}


class Results:
    """results.jsonl: rows appended as they finish; the keys of the rows already there."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.rows = read_rows(path) if resume else []
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.rows))  # drops a cut-off line
        self.done = {(r["task_id"], r["method"], r["repeat"]) for r in self.rows}

    def add(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)
        self.done.add((row["task_id"], row["method"], row["repeat"]))


def load_targets(model: str, device: str, threads: int | None, dtypes: Sequence[str]) -> tuple[dict[str, LoadedModel], Any, int]:
    """The target once per weight format (in order of first use), its tokenizer, and the thread count in
    force (set first when given): what every benchmark run starts from."""
    if threads is not None:
        torch.set_num_threads(threads)
    targets = {d: load_model(model, dtype=d, device=device) for d in dict.fromkeys(dtypes)}
    tok = next(iter(targets.values())).tokenizer
    if tok is None:
        raise SpecstackError(f"{model} has no tokenizer: the benchmark needs one to encode its prompts")
    return targets, tok, torch.get_num_threads()


def run_bench(plan: Plan, command: str) -> None:
    """Load, measure and report a checked plan; prints summary.md. command: the line that reproduces it."""
    s = plan.settings
    # 1. models, once per weight format; prompts; drafters and peers, once per method
    targets, tok, threads = load_targets(s.model, s.device, s.threads, [m.dtype for m in plan.methods])
    first = next(iter(targets.values()))
    sharegpt = s.prompts == "sharegpt"
    prompts = select_prompts(iter_prompts(s.prompts), lambda p: encode_prompt(tok, p.text, chat=p.chat),
                             s.limit, first.config.max_seq_len, s.max_new_tokens, skip_long=sharegpt,
                             max_prompt_tokens=SHAREGPT_MAX_PROMPT_TOKENS if sharegpt else None)
    sources = DraftSources.for_model(first.name, s.draft, s.draft_dtype, s.ngram, s.draft_vocab)
    peers = Peers(s.model, sources, s.sampling, s.device, threads,
                  tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, plan.llama_bin_dir)
    try:
        _run_single(plan, command, prompts, targets, peers, sources, threads, tok)
    finally:
        peers.close()  # llama-server processes


def _run_single(plan: Plan, command: str, prompts: Sequence[EncodedPrompt], targets: dict[str, LoadedModel],
                peers: Peers, sources: DraftSources, threads: int, tok: Any) -> None:
    s = plan.settings
    if s.batch_sizes:
        run_batches(plan, command, prompts, targets, peers, sources, threads)
        return
    n_ctx = max(len(p.ids) for p in prompts) + s.max_new_tokens + 64
    runners = build_runners(plan, targets, peers, sources, n_ctx)
    active = [m for m in plan.methods if m.label in runners.ready]
    if not active:
        raise SpecstackError("every method was skipped: nothing to run")

    # 2. rows: warm-up, then per prompt every method in turn, repeats times
    plan.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.out / "run.json", json.dumps(asdict(s), indent=1) + "\n")
    results = Results(plan.out / "results.jsonl", plan.resume)
    todo = [(p, r, m) for p in prompts for r in range(s.repeats) for m in active
            if (p.task_id, m.label, r) not in results.done]
    if todo:
        failed = measure(todo, active, runners.ready, results, targets, plan)
        runners.notes += [f"{label}: failed ({why}); its rows stop there, the other methods ran on"
                          for label, why in failed.items()]
    write_report(plan.out, results.rows, _meta(plan, runners, threads, command), list(s.methods), tok)
    print((plan.out / "summary.md").read_text(encoding="utf-8"))


def run_batches(plan: Plan, command: str, prompts: Sequence[EncodedPrompt], targets: dict[str, LoadedModel],
                peers: Peers, sources: DraftSources, threads: int) -> None:
    """Batch mode (bench/batched.py): batches of every size, the single-sequence `ar` reference rows,
    then the report."""
    s = plan.settings
    methods = build_batch_methods(plan, targets, peers, sources, peers.src, prompts, threads)
    if not methods.ready and methods.llama is None:
        raise SpecstackError("every method was skipped: nothing to run")
    plan.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.out / "run.json", json.dumps(asdict(s), indent=1) + "\n")
    results = Results(plan.out / "results.jsonl", plan.resume)
    warm: set[str] = set()

    def single(p: EncodedPrompt, dtype: str) -> dict[str, Any]:
        go = engine_runner(targets[dtype], None, s.sampling)
        if dtype not in warm:
            warm.add(dtype)
            go(p.ids, min(s.max_new_tokens, WARMUP_TOKENS))
        t0 = time.perf_counter()
        out = go(p.ids, s.max_new_tokens)
        return output_row(p.task_id, single_label(dtype, s.dtype), 0, out, time.perf_counter() - t0)

    measure_batches(plan, prompts, methods, results, single)
    runners = Runners({}, methods.skipped, methods.notes + tie_notes(plan), methods.peers)
    meta = _meta(plan, runners, threads, command)
    singles = dict.fromkeys(r["method"] for r in results.rows if "batch_size" not in r)
    ar = single_label(s.dtype, s.dtype)
    meta["baselines"] = {"ar": ar if ar in singles else next(iter(singles), None), "hf": None}
    order = [single_label(d, s.dtype) for d in dict.fromkeys(m.dtype for m in plan.methods)]
    order += [m.batch_label(b) for m in plan.methods for b in s.batch_sizes or ()]
    write_report(plan.out, results.rows, meta, order, targets[s.dtype].tokenizer if s.dtype in targets else None)
    print((plan.out / "summary.md").read_text(encoding="utf-8"))


def output_row(task: str, label: str, repeat: int, out: Output, seconds: float) -> dict[str, Any]:
    """The row of one generation (one prompt, one method, one repeat)."""
    return {"task_id": task, "method": label, "repeat": repeat, "dtype": out.dtype, "new_tokens": len(out.tokens),
            "seconds": seconds, "tokens_per_s": len(out.tokens) / seconds, "target_forwards": out.target_forwards,
            "tau": out.tau, "identical_to_ar": None, "origins": out.origins, "phases": out.phases,
            "accepted_per_step": out.accepted_per_step, "token_origins": out.token_origins, "drafted": out.drafted, "tokens": out.tokens}


def measure(todo: Sequence[tuple[Prompt, int, BenchMethod]], methods: Sequence[BenchMethod],
            runners: dict[str, Runner], results: Results, targets: dict[str, LoadedModel], plan: Plan
            ) -> dict[str, str]:
    """Warm-up, then the rows; returns the peers that failed on the way (label -> why): a peer that crashes,
    hangs past its timeout or exits loses its remaining generations, the other methods go on."""
    new_tokens, sampling = plan.settings.max_new_tokens, plan.settings.sampling
    failed: dict[str, str] = {}

    def call(m: BenchMethod, ids: list[int], n: int) -> Output | None:
        if m.label in failed:
            return None
        if not m.peer:
            return runners[m.label](ids, n)
        try:
            return runners[m.label](ids, n)
        except SpecstackError as e:
            failed[m.label] = str(e)
            print(f"\n{m.label}: failed ({e}); the run goes on without it", file=sys.stderr)
            return None

    ar_of = {}  # weight format -> label of the list's `ar` in it (the identical_to_ar reference)
    for m in methods:
        if m.name == "ar":
            ar_of.setdefault(m.dtype, m.label)
    refs: dict[tuple[str, str], list[int]] = {}
    for r in results.rows:
        d = next((d for d, label in ar_of.items() if label == r["method"]), None)
        if d is not None and r["repeat"] == 0:
            refs[(r["task_id"], d)] = r["tokens"]

    print(f"warming up {len(methods)} methods", file=sys.stderr)
    first_ids = todo[0][0].ids
    for m in methods:
        interrupt.check()  # Ctrl-C stops the run between generations (peers have no steps we see)
        call(m, first_ids, min(new_tokens, WARMUP_TOKENS))

    totals = {m.label: [0, 0.0] for m in methods}
    bar = tqdm(total=len(todo), desc="bench", unit="gen", file=sys.stderr)
    for task in dict.fromkeys(p.task_id for p, _, _ in todo):
        items = [(p, r, m) for p, r, m in todo if p.task_id == task]
        prompt = items[0][0]
        pending: list[tuple[dict[str, Any], str]] = []
        if sampling.greedy:  # references the list's `ar` will not produce on this prompt: run once, untimed
            coming = {m.dtype for _, _, m in items if ar_of.get(m.dtype) == m.label}
            for d in dict.fromkeys(m.dtype for _, _, m in items):
                if (task, d) not in refs and d not in coming:
                    refs[(task, d)] = engine_runner(targets[d], None, sampling)(prompt.ids, new_tokens).tokens
        for p, r, m in items:
            interrupt.check()
            t0 = time.perf_counter()
            got = call(m, p.ids, new_tokens)
            seconds = time.perf_counter() - t0
            if got is None:  # a failed peer: no row
                bar.update()
                continue
            out = got
            row = output_row(task, m.label, r, out, seconds)
            if sampling.greedy and ar_of.get(m.dtype) == m.label:
                refs.setdefault((task, m.dtype), out.tokens)
            pending.append((row, m.dtype))
            # write every row whose reference is known (greedy), or at once (sampling: no reference)
            keep = []
            for row_, d in pending:
                if sampling.greedy and (task, d) not in refs:
                    keep.append((row_, d))
                    continue
                if sampling.greedy:
                    row_["identical_to_ar"] = row_["tokens"] == refs[(task, d)]
                results.add(row_)
            pending = keep
            totals[m.label][0] += len(out.tokens)
            totals[m.label][1] += seconds
            bar.set_postfix_str(" | ".join(f"{k} {n / s:.1f}" for k, (n, s) in totals.items() if s > 0) + " tok/s")
            bar.update()
        assert not pending, "every reference is known by the end of a prompt"
    bar.close()
    return failed
