"""Batch mode of `specstack bench` (--batch-sizes): every method decodes B sequences at once.

Protocol: for each batch size B, the prompt set is cut into batches of B consecutive prompts; the
last batch, when the set does not divide by B, is filled by wrapping around to the set's first
prompts (so every batch holds B rows and every prompt runs at least once at every B). Each batch is
run by every method in turn, the order rotated by one from batch to batch (and repeat to repeat) so
drift over the run falls on every method alike; each (method, B) is warmed up once on short prompts
first. Every row generates exactly max-new-tokens tokens (EOS ignored). Engine methods run on the
batched engine (engine/batched.py), one engine per batch sized for it (built off the clock), with a
drafter per row for speculative methods; `hf` is transformers' batched `generate` with left padding.
A batch's wall time is timed around the decoding call alone, prefill included.

The reference: every prompt decoded alone by our one-row `ar` (engine.batched.generate) at
each weight format the batch methods ask for, once, just before the first batch that holds it. Its
rows are timed and kept (method `ar`, or `ar:dtype=D` at another format than --dtype: the
single-sequence baseline); under greedy decoding every batch row is marked `identical_to_ar` against
it. llama-batched-bench (`llamacpp-batched`) runs last, once (bench/llama_batched.py).

Rows: one per sequence (task_id, method `METHOD@bB`, base_method, batch_size, batch, slot, repeat,
tokens, ...): `seconds` is its batch's wall time and `tokens_per_s` the row's own rate; the batch's
engine phases (`batch_phases`), steps, layouts and draft-model forwards ride on each of its rows
(report.py counts them once per batch).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from specstack import interrupt
from specstack.bench.datasets import EncodedPrompt
from specstack.bench.llama_batched import LlamaBatched, find_binary, record_rows
from specstack.bench.llama_build import binary_about
from specstack.bench.peer_table import PEERS
from specstack.bench.peers import ForwardCounter, hf_about, hf_dtype, hf_generate_batch
from specstack.bench.plan import BenchMethod, Plan
from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.batch_length import BatchLength
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.methods import DraftSources, MethodSpec, drafter_factory, length_rule
from specstack.engine.rows import DrafterFactory, DrafterPool
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel

WARMUP_TOKENS = 16
WARMUP_PROMPT_TOKENS = 32  # a warm-up needs the code paths, not a long prefill of B long prompts


# ---------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------
def make_batches(prompts: Sequence[EncodedPrompt], batch_size: int) -> list[list[EncodedPrompt]]:
    """ceil(n / B) batches of B consecutive prompts, the last one filled by wrapping around to the start
    (a set smaller than B wraps as often as it takes)."""
    n = len(prompts)
    return [[prompts[(i * batch_size + j) % n] for j in range(batch_size)] for i in range(-(-n // batch_size))]


def rotated(methods: Sequence[BenchMethod], k: int) -> list[BenchMethod]:
    k %= len(methods)
    return [*methods[k:], *methods[:k]]


# ---------------------------------------------------------------------------------------------------
# Runners: prompt ids of a batch, n -> BatchOutput (everything loaded up front)
# ---------------------------------------------------------------------------------------------------
@dataclass
class BatchOutput:
    tokens: list[list[int]]  # per row
    seconds: float  # the batch's wall time
    dtype: str  # the weight format it ran in
    target_forwards: list[int | None]
    taus: list[float | None]
    phases: dict[str, float] | None = None  # the engine's draft / target / verify / overhead seconds
    steps: int | None = None  # engine steps
    layouts: dict[str, int] | None = None  # steps per layout (pad, split)
    draft_forwards: int | None = None  # the draft models' forwards over all steps (a group's serve all its rows)


BatchRunner = Callable[[list[list[int]], int], BatchOutput]


def engine_batch_runner(lm: LoadedModel, drafters: DrafterFactory | None, layout: str, sampling: SamplingParams,
                        length: Callable[[int], BatchLength] | None = None) -> BatchRunner:
    """drafters: the method's drafter factory (None: ar); its drafters are lent from one pool shared by
    every batch, so a batch reuses the drafters the last one made. length(B): a new draft-length rule for
    a batch of B rows (the method's: engine/methods.py length_rule)."""
    pool = DrafterPool()

    def go(prompts: list[list[int]], n: int) -> BatchOutput:
        gen = GenerationConfig(max_new_tokens=n, sampling=sampling, stop_on_eos=False)
        longest = max(len(p) for p in prompts) + n
        engine = BatchEngine(lm, max_rows=len(prompts), max_context=min(lm.config.max_seq_len, longest),
                             layout=layout,  # type: ignore[arg-type]  # checked by plan.LAYOUTS
                             length=None if length is None else length(len(prompts)), drafters=drafters, pool=pool)
        requests = [BatchRequest(p, gen) for p in prompts]
        t0 = time.perf_counter()
        results = engine.run(requests)
        seconds = time.perf_counter() - t0
        st = engine.stats
        return BatchOutput([r.tokens for r in results], seconds, lm.fmt, [r.stats.target_forwards for r in results],
                           [r.stats.tau for r in results], st.phase_seconds(), st.steps, dict(st.layouts),
                           st.draft_forwards)

    return go


def method_batch_runner(target: LoadedModel, method: MethodSpec, sources: DraftSources, sampling: SamplingParams,
                        device: str = "cpu", layout: str = "auto") -> BatchRunner:
    """The batched engine running `method` (`ar` included): its drafters and a fresh length rule per batch."""
    return engine_batch_runner(target, drafter_factory(method, target, sources, device), layout, sampling,
                               lambda rows: length_rule(method, target, rows))


def hf_batch_runner(model: Any, counter: ForwardCounter, dtype: str, sampling: SamplingParams,
                    pad_id: int | None) -> BatchRunner:
    def go(prompts: list[list[int]], n: int) -> BatchOutput:
        before = counter.calls
        t0 = time.perf_counter()
        tokens = hf_generate_batch(model, prompts, n, sampling, pad_id)
        seconds = time.perf_counter() - t0
        calls = counter.calls - before  # the prefill forward emits the first token
        return BatchOutput(tokens, seconds, dtype, [max(0, calls - 1)] * len(prompts),
                           [len(t) / calls if calls else None for t in tokens])

    return go


class HfModels(Protocol):
    pad_id: int | None

    def hf_model(self, dtype: str) -> tuple[Any, ForwardCounter]: ...


@dataclass
class BatchMethods:
    """Every method of a batch plan made ready, or skipped with the reason; notes for the summary."""

    ready: dict[str, BatchRunner] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    llama: tuple[BenchMethod, LlamaBatched] | None = None
    peers: dict[str, str] = field(default_factory=dict)  # a peer's label -> what ran it


def build_batch_methods(plan: Plan, targets: dict[str, LoadedModel], hf: HfModels, sources: DraftSources,
                        gguf: Any, prompts: Sequence[EncodedPrompt], threads: int) -> BatchMethods:
    """Runners for the engine methods and `hf`; llama-batched-bench's run for `llamacpp-batched` (gguf:
    the model's registry source)."""
    s = plan.settings
    out = BatchMethods()
    for m in plan.methods:
        if m.peer and PEERS[m.name].runs == "llama-batched-bench":
            binary, why = find_binary(plan.llama_bin_dir)
            if gguf.kind != "gguf":
                why = "the model is not a GGUF file"
            if binary is None or why:
                out.skipped[m.label] = why
                print(f"{m.label}: skipped ({why})", file=sys.stderr)
                continue
            mean_prompt = round(sum(len(p.ids) for p in prompts) / len(prompts))
            out.llama = (m, LlamaBatched(binary, gguf.path, max(1, mean_prompt), s.max_new_tokens,
                                         tuple(sorted(s.batch_sizes or ())), threads))
            out.peers[m.label] = binary_about(binary)
            out.notes.append(f"{m.label}: llama.cpp's llama-batched-bench on the same GGUF (its own quantization): "
                             f"random tokens, every sequence {mean_prompt} prompt tokens (the set's mean), then "
                             f"{s.max_new_tokens} new tokens each; tokens/s is its generation speed (speed_tg, prefill "
                             "excluded, where ours include it); the column with prefill counts its prompt processing")
        elif m.peer:  # hf
            dt = hf_dtype(m.dtype)
            if dt != m.dtype:
                out.notes.append(f"{m.label}: transformers cannot run {m.dtype} weights: it ran {dt}")
            model, counter = hf.hf_model(dt)
            out.ready[m.label] = hf_batch_runner(model, counter, dt, s.sampling, hf.pad_id)
            out.peers[m.label] = hf_about(dt, s.device)
        else:
            target = targets[m.dtype]
            spec = m.spec
            assert spec is not None  # an engine method
            out.ready[m.label] = method_batch_runner(target, spec, sources, s.sampling, s.device, m.layout or "auto")
    out.notes.append("batches: B consecutive prompts of the set; the last batch is filled by wrapping around to the "
                     "set's first prompts (every batch holds B rows)")
    return out


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
class RowSink(Protocol):
    rows: list[dict[str, Any]]

    def add(self, row: dict[str, Any]) -> None: ...


def single_label(dtype: str, default_dtype: str) -> str:
    """The single-sequence `ar` rows' method at a weight format."""
    return "ar" if dtype == default_dtype else f"ar:dtype={dtype}"


# (prompt, weight format) -> the row of that prompt decoded alone by our single-sequence ar
SingleRun = Callable[[EncodedPrompt, str], dict[str, Any]]


def measure_batches(plan: Plan, prompts: Sequence[EncodedPrompt], methods: BatchMethods, results: RowSink,
                    single: SingleRun) -> None:
    """Every (batch size, batch, repeat, method) not yet in `results`, in the module doc's order, then
    llama-batched-bench; rows go to `results` batch by batch."""
    s = plan.settings
    n, greedy = s.max_new_tokens, s.sampling.greedy
    active = [m for m in plan.methods if m.label in methods.ready]
    # the single-sequence reference at every weight format the batch methods ask for
    formats = list(dict.fromkeys(m.dtype for m in active))
    labels = {d: single_label(d, s.dtype) for d in formats}
    refs: dict[tuple[str, str], list[int]] = {}
    for r in results.rows:
        for d, label in labels.items():
            if r["method"] == label and "batch_size" not in r and r["repeat"] == 0:
                refs[(r["task_id"], d)] = r["tokens"]
    done = {(r["method"], r["repeat"], r["batch"]) for r in results.rows if "batch_size" in r}
    plan_items = {b: [(bi, rep, m) for bi in range(len(make_batches(prompts, b))) for rep in range(s.repeats)
                      for m in active if (m.batch_label(b), rep, bi) not in done] for b in s.batch_sizes or ()}
    bar = tqdm(total=sum(map(len, plan_items.values())), desc="bench batches", unit="batch", file=sys.stderr)
    totals: dict[str, list[float]] = {}
    for b, todo in plan_items.items():
        if not todo:
            continue
        batches = make_batches(prompts, b)
        print(f"B = {b}: warming up {len({m.label for _, _, m in todo})} methods", file=sys.stderr)
        short = [p.ids[-WARMUP_PROMPT_TOKENS:] for p in batches[0]]
        for label in dict.fromkeys(m.label for _, _, m in todo):
            interrupt.check()
            methods.ready[label](short, min(n, WARMUP_TOKENS))
        turn = 0
        for bi, batch in enumerate(batches):
            items = [(rep, m) for bj, rep, m in todo if bj == bi]
            if not items:
                continue
            for p in {p.task_id: p for p in batch}.values():  # each prompt once, in batch order
                for d in formats:
                    if (p.task_id, d) not in refs:
                        interrupt.check()
                        row = single(p, d)
                        results.add(row)
                        refs[(p.task_id, d)] = row["tokens"]
            for rep in dict.fromkeys(rep for rep, _ in items):
                for m in rotated([m for r_, m in items if r_ == rep], turn):
                    interrupt.check()
                    out = methods.ready[m.label]([p.ids for p in batch], n)
                    for row in batch_rows(m, b, bi, rep, batch, out):
                        if greedy:
                            row["identical_to_ar"] = row["tokens"] == refs[(row["task_id"], m.dtype)]
                        results.add(row)
                    t = totals.setdefault(m.batch_label(b), [0, 0.0])
                    t[0] += sum(len(x) for x in out.tokens)
                    t[1] += out.seconds
                    bar.set_postfix_str(" | ".join(f"{k} {tok / sec:.1f}" for k, (tok, sec) in totals.items()
                                                   if sec > 0 and k.endswith(f"@b{b}")) + " tok/s")
                    bar.update()
                turn += 1
    bar.close()
    if methods.llama is not None:
        m, llama = methods.llama
        if not any(r.get("base_method") == m.label for r in results.rows):
            interrupt.check()
            print(f"{m.label}: {' '.join(llama.command())}", file=sys.stderr)
            try:
                records = llama.run()
            except SpecstackError as e:
                methods.skipped[m.label] = str(e)
                print(f"{m.label}: skipped ({e})", file=sys.stderr)
                records = []
            interrupt.check()  # Ctrl-C reaches the child too: do not record a cut-off run
            ran = {int(rec["pl"]) for rec in records}
            missing = [b for b in llama.batch_sizes if b not in ran]
            if records and missing:
                methods.notes.append(f"{m.label}: llama-batched-bench ran no batch of {missing} (its context of "
                                     f"{llama.context} tokens is too small for them)")
            for row in record_rows(records, m.label):
                results.add(row)


def batch_rows(m: BenchMethod, b: int, bi: int, rep: int, batch: Sequence[EncodedPrompt],
               out: BatchOutput) -> list[dict[str, Any]]:
    """The rows of one batch: one per sequence."""
    rows = []
    for slot, (p, tokens) in enumerate(zip(batch, out.tokens, strict=True)):
        rows.append({"task_id": p.task_id, "method": m.batch_label(b), "base_method": m.label, "batch_size": b,
                     "batch": bi, "slot": slot, "repeat": rep, "dtype": out.dtype, "new_tokens": len(tokens),
                     "seconds": out.seconds, "tokens_per_s": len(tokens) / out.seconds,
                     "target_forwards": out.target_forwards[slot], "tau": out.taus[slot], "identical_to_ar": None,
                     "batch_phases": out.phases, "batch_steps": out.steps, "batch_layouts": out.layouts,
                     "batch_draft_forwards": out.draft_forwards,
                     "tokens": tokens})
    return rows

