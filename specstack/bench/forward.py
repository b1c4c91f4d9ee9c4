"""The `specstack bench-forward` run: specstack's forward and greedy generation against transformers
(and llama.cpp if present). The protocol is the command's help (specstack/cli/bench_forward.py).

Terms: a forward step runs T query tokens at a fixed committed context and never commits (a
ForwardStep, engine/timing.py); part 1 times such steps per method and T, interleaved with the
method order rotated per repeat so machine drift cancels, for one row and for B rows (the batched
curve; with `ragged`, one row's prompt chunk beside B - 1 decoding rows in the PAD and SPLIT layouts);
part 2 times greedy generations of exactly new_tokens tokens, interleaved per prompt, against
transformers' bf16 `generate` (HF_GEN_REFERENCE). Beside them, each format's floor: the bytes a
one-token step reads at the machine's measured bandwidth (bench/bandwidth.py). The report (its tables and figure in bench/forward_report.py): the JSON file; with B > 1 rows also
a markdown file beside it and, for two row counts or more, the curve as a figure (`report_paths`).
"""
from __future__ import annotations

import inspect
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specstack.attention import LAYOUTS, Layout
from specstack.bench import llama_bench, llama_cpp_peer
from specstack.bench.bandwidth import measure_bandwidth, measure_read_bandwidth, step_limits
from specstack.bench.datasets import humaneval_prompts
from specstack.bench.forward_report import (
    ForwardRow,
    ForwardSettings,
    GenerationRow,
    RaggedRow,
    batched,
    render,
    report_paths,
    write_figure,
)
from specstack.bench.llama_bench import LlamaForward
from specstack.bench.peer_child import PeerChild
from specstack.bench.peers import hf_generate, load_hf
from specstack.config import GenerationConfig, SamplingParams
from specstack.engine.batched import generate
from specstack.engine.timing import (
    ForwardStep,
    RowForwards,
    forward_steps,
    ragged_tokens,
    random_context,
    tree_parents,
)
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.models.registry import ModelSource, resolve
from specstack.validate import fits_context

HF_GEN_REFERENCE = "hf bf16"  # the method speed-ups and token matches of part 2 are measured against

GenerateFn = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> new token ids


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
def context_ids(tokenizer: Any, n: int, vocab_size: int) -> list[int]:
    """n token ids of real text (HumanEval prompts, concatenated), or seeded random ids without a tokenizer."""
    if tokenizer is None:
        return random_context(n, vocab_size)
    ids: list[int] = []
    for k in itertools.count(1):
        ids = tokenizer("\n".join(humaneval_prompts(8 * k)), add_special_tokens=False).input_ids
        if len(ids) >= n or k > 20:
            break
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def _hf_cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache` (`past_key_values` is deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_forward_step(model: Any, ctx: list[int]) -> ForwardStep:
    """Prefill ctx into a DynamicCache; each step runs T tokens and crops the cache back."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = {_hf_cache_kwarg(model): cache, "use_cache": True}
    with torch.inference_mode():
        model(input_ids=torch.tensor([ctx]), **kw)
    length = cache.get_seq_length()

    def step(tokens: torch.Tensor) -> None:
        with torch.inference_mode():
            model(input_ids=tokens, **kw)
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)  # negative: remove that many tokens (transformers 4.x and 5.x alike)

    return step


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def time_interleaved(calls: dict[str, Callable[[], object]], repeats: int, warmup: int, bar: tqdm
                     ) -> dict[str, list[float]]:
    """Warm every call up, then time them all interleaved, their order rotated per repeat (ms each)."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in _rotated(names, r):
            t0 = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
        bar.update()
    return times


def time_forwards(steps: dict[str, ForwardStep], token_counts: Sequence[int], vocab_size: int,
                  repeats: int, warmup: int) -> list[ForwardRow]:
    """One row: per T, every method's forward of the same tokens [1, T], interleaved."""
    gen = torch.Generator().manual_seed(0)
    rows: list[ForwardRow] = []
    bar = tqdm(total=len(token_counts) * repeats, desc="forward", unit="round", leave=False)
    for t in token_counts:
        tokens = torch.randint(0, vocab_size, (1, t), generator=gen)
        times = time_interleaved({n: partial(step, tokens) for n, step in steps.items()}, repeats, warmup, bar)
        rows += [ForwardRow(n, t, statistics.median(ts), min(ts), ts) for n, ts in times.items()]
    bar.close()
    return rows


def ragged_counts(rows: int, chunk: int) -> list[int]:
    """Tokens per row of a ragged step: rows - 1 decoding rows of one token, then a joining row's
    prompt chunk (last: the engine appends a new row after the live ones)."""
    return [1] * (rows - 1) + [chunk]


def time_rows(fwds: dict[str, RowForwards], row_counts: Sequence[int], token_counts: Sequence[int],
              chunks: Sequence[int], vocab_size: int, repeats: int, warmup: int
              ) -> tuple[list[ForwardRow], list[RaggedRow]]:
    """B rows (every B > 1 of row_counts, from the most down: each format's cache drops rows as it
    goes): per T, every format's chain forward of the same tokens [B, T], interleaved; then, with
    chunks, per C (1 first: the uniform step) every format in both layouts, interleaved."""
    gen = torch.Generator().manual_seed(0)
    sizes = sorted((b for b in row_counts if b > 1), reverse=True)
    cases = [1, *(c for c in chunks if c != 1)] if chunks else []
    bar = tqdm(total=len(sizes) * (len(token_counts) + len(cases)) * repeats, desc="rows", unit="round", leave=False)
    chain: list[ForwardRow] = []
    ragged: list[RaggedRow] = []
    for b in sizes:
        for f in fwds.values():
            f.keep(b)
        for t in token_counts:
            tokens = torch.randint(0, vocab_size, (b, t), generator=gen)
            times = time_interleaved({n: partial(f.chain, tokens) for n, f in fwds.items()}, repeats, warmup, bar)
            chain += [ForwardRow(f"{n} chain", t, statistics.median(ts), min(ts), ts, rows=b) for n, ts in times.items()]
        for c in cases:
            counts = ragged_counts(b, c)
            calls: dict[str, Callable[[], object]] = {}
            keys: dict[str, tuple[str, Layout]] = {}
            for n, f in fwds.items():
                for layout in LAYOUTS:
                    calls[f"{n} {layout}"] = partial(f.ragged(counts, layout),
                                                     ragged_tokens(counts, layout, vocab_size, gen))
                    keys[f"{n} {layout}"] = (n, layout)
            times = time_interleaved(calls, repeats, warmup, bar)
            ragged += [RaggedRow(keys[k][0], b, c, keys[k][1], statistics.median(ts), min(ts), ts)
                       for k, ts in times.items()]
    bar.close()
    order = {b: i for i, b in enumerate(row_counts)}
    chain.sort(key=lambda r: order[r.rows])  # stable: formats and T keep their order within a B
    ragged.sort(key=lambda r: order[r.rows])
    return chain, ragged


# ---------------------------------------------------------------------------------------------------
# Part 2: generation
# ---------------------------------------------------------------------------------------------------
def ours_generate_fn(lm: LoadedModel) -> GenerateFn:
    def run_one(ids: list[int], n: int) -> list[int]:
        return generate(lm, ids, GenerationConfig(max_new_tokens=n, stop_on_eos=False)).tokens

    return run_one


def hf_generate_fn(model: Any, pad_id: int | None) -> GenerateFn:
    def run_one(ids: list[int], n: int) -> list[int]:
        return hf_generate(model, ids, n, SamplingParams(), pad_id)

    return run_one


def llama_cpp_generate_fn(child: PeerChild) -> GenerateFn:
    def run_one(ids: list[int], n: int) -> list[int]:
        return child.generate(ids, n, SamplingParams())

    return run_one


def _llama_cpp_child(src: ModelSource, threads: int, n_ctx: int, notes: list[str]) -> PeerChild | None:
    """llama-cpp-python on the same GGUF in a process of its own, or None with the reason in `notes`."""
    why = llama_cpp_peer.unavailable(src.kind == "gguf")
    if why is None:
        try:
            return PeerChild("llama-cpp-python", gguf=str(src.path), threads=threads, n_ctx=n_ctx)
        except SpecstackError as e:
            why = f"failed: {e}"
    notes.append(f"llama.cpp generation: skipped ({why})")
    return None


def run_generation(fns: dict[str, GenerateFn], prompts: Sequence[list[int]], new_tokens: int
                   ) -> list[GenerationRow]:
    """Every method on every prompt, interleaved per prompt (order rotated); one short warm-up each."""
    names = list(fns)
    for name in names:
        fns[name](prompts[0], 2)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for i, ids in enumerate(tqdm(prompts, desc="generate", unit="prompt", leave=False)):
        for name in _rotated(names, i):
            t0 = time.perf_counter()
            out = fns[name](ids, new_tokens)
            seconds[name].append(time.perf_counter() - t0)
            outputs[name].append(out)
    return [_generation_row(n, seconds, outputs) for n in names]


def _generation_row(name: str, seconds: dict[str, list[float]], outputs: dict[str, list[list[int]]]
                    ) -> GenerationRow:
    secs, outs = seconds[name], outputs[name]
    total_tokens, total_s = sum(len(o) for o in outs), sum(secs)
    speedup = identical = None
    if HF_GEN_REFERENCE in seconds:
        ref_s, ref_o = seconds[HF_GEN_REFERENCE], outputs[HF_GEN_REFERENCE]
        speedup = statistics.mean(r / s for r, s in zip(ref_s, secs, strict=True))
        identical = None if name == HF_GEN_REFERENCE else sum(a == b for a, b in zip(outs, ref_o, strict=True))
    return GenerationRow(name, total_tokens, total_s, total_tokens / total_s, speedup, identical, secs)


def run_llama_bench(s: ForwardSettings, src: Any) -> tuple[list[LlamaForward], list[str]]:
    """llama-bench's forwards at our T and context, and a note of what ran (or why nothing did): a peer
    that is missing or fails is a line in the report, never the end of the run."""
    if s.skip_llama:
        return [], []
    if src.kind != "gguf":
        return [], [f"llama-bench: not run ({s.model} is not a GGUF file)"]
    binary, why = llama_bench.find(s.llama_bin_dir)
    if binary is None:
        return [], [f"llama-bench: not run ({why})"]
    run = llama_bench.LlamaBench(binary, src.path, tuple(s.tokens), s.context, s.threads, max(3, min(s.repeats, 10)))
    print(f"llama-bench: {' '.join(run.command())}", file=sys.stderr, flush=True)
    try:
        got = run.run()
    except SpecstackError as e:
        return [], [f"llama-bench: failed ({e})"]
    return got, [f"llama-bench: `{' '.join(run.command())}`"]


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def machine_info(s: ForwardSettings, command: str) -> dict[str, Any]:
    v = versions()
    return {
        "cpu": cpu_model(), "threads": s.threads, "torch": v["torch"], "transformers": v["transformers"],
        "python": v["python"], "date": now(), "command": command,
    }


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def run_forward_bench(settings: ForwardSettings, command: str) -> None:
    """Both parts; prints the report and writes settings.out. command: the line that reproduces it."""
    s = settings
    torch.set_num_threads(s.threads)
    src = resolve(s.model)
    info = machine_info(s, command)

    ours = {fmt: load_model(s.model, dtype=fmt) for fmt in s.formats}
    first = ours[s.formats[0]]
    bandwidth, read_bandwidth = measure_bandwidth(), measure_read_bandwidth()
    limits = step_limits(ours, bandwidth, read_bandwidth)
    info["bandwidth_gbs"], info["read_bandwidth_gbs"] = bandwidth / 1e9, read_bandwidth / 1e9
    widest, flag = max(s.tokens), "--tokens"
    if s.ragged and max(s.chunks) > widest:
        widest, flag = max(s.chunks), "--chunk"
    fits_context(f"--context {s.context} + the widest {flag} {widest}", s.context + widest,
                 first.config.max_seq_len)  # before any forward is timed
    tok, vocab = first.tokenizer, first.config.vocab_size
    one_row = 1 in s.rows  # transformers and trees: one row only
    hf_needed = [*(s.hf_dtypes if one_row else []), *(["bf16"] if s.prompts > 0 else [])]  # bf16: generation
    hf = {} if s.skip_hf else {d: load_hf(src, d) for d in dict.fromkeys(hf_needed)}

    # 1. forwards: one row (chains, trees, transformers), then B rows (chains; ragged rows)
    ctx = context_ids(tok, s.context, vocab)
    fwd: list[ForwardRow] = []
    if one_row:
        steps: dict[str, ForwardStep] = {}
        for lm in ours.values():
            steps |= forward_steps(lm, ctx, max(s.tokens))
        steps |= {f"hf {d}": hf_forward_step(hf[d], ctx) for d in s.hf_dtypes if d in hf}
        fwd = time_forwards(steps, s.tokens, vocab, s.repeats, s.warmup)
        del steps  # their caches
    ragged: list[RaggedRow] = []
    most = max(s.rows)
    if most > 1:
        fwds = {f"specstack {fmt}": RowForwards(lm, ctx, most, widest) for fmt, lm in ours.items()}
        chain, ragged = time_rows(fwds, s.rows, s.tokens, s.chunks if s.ragged else [], vocab, s.repeats, s.warmup)
        fwd += chain
        del fwds

    # 1b. llama.cpp's forwards of the same T on the same GGUF (a separate process, after ours)
    llama, notes = run_llama_bench(s, src) if one_row else ([], [])

    # 2. generation
    gen: list[GenerationRow] | None = None
    if s.prompts > 0:
        if tok is None:
            raise SpecstackError("generation needs a tokenizer; pass --prompts 0 to skip it")
        prompts = [list(tok(p, add_special_tokens=True).input_ids) for p in humaneval_prompts(s.prompts)]
        fns = {f"specstack {fmt}": ours_generate_fn(lm) for fmt, lm in ours.items()}
        if hf:
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            fns[HF_GEN_REFERENCE] = hf_generate_fn(hf["bf16"], pad)
        child = _llama_cpp_child(src, s.threads, max(map(len, prompts)) + s.new_tokens + 8, notes)
        if child is not None:
            fns["llama.cpp"] = llama_cpp_generate_fn(child)
        try:
            gen = run_generation(fns, prompts, s.new_tokens)
        finally:
            if child is not None:
                child.close()

    md, png = report_paths(s.out)
    # the settings as JSON values (its paths: --out, --llama-bin-dir, as strings)
    settings_json = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()}
    results = {"machine": info, "settings": settings_json,
               "tree_parents": {t: tree_parents(t) for t in s.tokens},
               "limits": [asdict(lim) for lim in limits], "forward": [asdict(r) for r in fwd], "ragged": [asdict(r) for r in ragged] if s.ragged else None,
               "generation": None if gen is None else [asdict(r) for r in gen],
               "llama_bench": [asdict(f) for f in llama], "notes": notes}
    atomic_write_text(s.out, json.dumps(results, indent=1) + "\n", parents=True)
    if not batched(s.rows):  # one row: the JSON file alone, as before rows existed
        print(render(info, s, fwd, gen, notes=notes, limits=limits, llama=llama))
        print(f"\nresults written to {s.out}", file=sys.stderr)
        return
    note = write_figure(fwd, s.rows, png)
    report = render(info, s, fwd, gen, ragged, [*notes, *([note] if note else [])], limits, llama)
    atomic_write_text(md, report + "\n")
    print(report)
    print(f"\nresults written to {s.out} and {md}" + (f" ({png.name} beside them)" if png.is_file() else ""),
          file=sys.stderr)
