"""The `specstack bench-forward` run: specstack's forward and greedy generation against transformers
(and llama.cpp if present). The protocol is the command's help (specstack/cli/bench_forward.py).

Terms: a forward step runs T query tokens at a fixed committed context and never commits (a
ForwardStep, engine/timing.py); part 1 times such steps per method and T, interleaved with the
method order rotated per repeat so machine drift cancels; part 2 times greedy generations of exactly
new_tokens tokens, interleaved per prompt, against transformers' bf16 `generate` (HF_GEN_REFERENCE).
"""
from __future__ import annotations

import inspect
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specstack.bench.datasets import humaneval_prompts
from specstack.bench.peers import (
    hf_generate,
    llama_cpp_generate,
    load_hf,
    load_llama_cpp,
)
from specstack.config import GenerationConfig, SamplingParams
from specstack.engine.autoregressive import generate
from specstack.engine.timing import (
    ForwardStep,
    forward_steps,
    random_context,
    tree_parents,
)
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.models.registry import resolve
from specstack.validate import fits_context

HF_GEN_REFERENCE = "hf bf16"  # the method speed-ups and token matches of part 2 are measured against

GenerateFn = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> new token ids


@dataclass(frozen=True)
class ForwardSettings:
    """A run's settings, in the results file's order and names."""

    model: str
    formats: list[str]  # specstack weight formats
    tokens: list[int]  # query tokens T per forward
    context: int  # committed context before the timed forwards
    repeats: int  # timed forwards per method and T (median reported)
    warmup: int  # untimed forwards per method and T
    prompts: int  # HumanEval prompts for generation (0: no part 2)
    new_tokens: int  # tokens generated per prompt (EOS ignored)
    threads: int  # torch (and llama.cpp) threads
    hf_dtypes: list[str]  # transformers dtypes for the forward timings
    skip_hf: bool  # no transformers at all
    out: Path  # the JSON results file


@dataclass
class ForwardRow:
    method: str
    tokens: int
    median_ms: float
    min_ms: float
    times_ms: list[float]


@dataclass
class GenerationRow:
    method: str
    new_tokens: int
    seconds: float
    tokens_per_s: float
    mean_speedup_vs_hf_bf16: float | None
    identical_to_hf_bf16: int | None
    per_prompt_seconds: list[float] = field(default_factory=list)


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


def _time_ms(step: ForwardStep, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    step(tokens)
    return (time.perf_counter() - t0) * 1e3


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def time_forwards(steps: dict[str, ForwardStep], token_counts: Sequence[int], vocab_size: int,
                  repeats: int, warmup: int) -> list[ForwardRow]:
    """Per T: warm every method up, then time all methods interleaved, rotating their order."""
    names = list(steps)
    gen = torch.Generator().manual_seed(0)
    rows: list[ForwardRow] = []
    bar = tqdm(total=len(token_counts) * repeats, desc="forward", unit="round", leave=False)
    for t in token_counts:
        tokens = torch.randint(0, vocab_size, (1, t), generator=gen)
        for name in names:
            for _ in range(warmup):
                steps[name](tokens)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            for name in _rotated(names, r):
                times[name].append(_time_ms(steps[name], tokens))
            bar.update()
        rows += [ForwardRow(n, t, statistics.median(ts), min(ts), ts) for n, ts in times.items()]
    bar.close()
    return rows


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


def llama_cpp_generate_fn(llm: Any) -> GenerateFn:
    def run_one(ids: list[int], n: int) -> list[int]:
        return llama_cpp_generate(llm, ids, n, SamplingParams())

    return run_one


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


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def machine_info(s: ForwardSettings, command: str) -> dict[str, Any]:
    v = versions()
    return {
        "cpu": cpu_model(), "threads": s.threads, "torch": v["torch"], "transformers": v["transformers"],
        "python": v["python"], "date": now(), "command": command,
    }


def forward_table(rows: Sequence[ForwardRow], token_counts: Sequence[int]) -> str:
    methods = list(dict.fromkeys(r.method for r in rows))
    ms = {(r.method, r.tokens): r.median_ms for r in rows}
    lines = ["| method | " + " | ".join(f"T = {t}" for t in token_counts) + " |",
             "|---|" + "---:|" * len(token_counts)]
    lines += [f"| {m} | " + " | ".join(f"{ms[m, t]:.1f}" for t in token_counts) + " |" for m in methods]
    return "\n".join(lines)


def generation_table(rows: Sequence[GenerationRow], n_prompts: int) -> str:
    def opt(v: float | int | None, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    lines = ["| method | tokens | seconds | tokens/s | mean speed-up vs hf bf16 | identical to hf bf16 |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.method} | {r.new_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | "
              f"{opt(r.mean_speedup_vs_hf_bf16, '.2f')} | {opt(r.identical_to_hf_bf16, 'd')}"
              f"{'' if r.identical_to_hf_bf16 is None else f' / {n_prompts}'} |" for r in rows]
    return "\n".join(lines)


def render(info: dict[str, Any], args: ForwardSettings, fwd: Sequence[ForwardRow],
           gen: Sequence[GenerationRow] | None) -> str:
    parts = [
        f"# Forward and generation benchmark: {args.model}", "",
        f"- CPU: {info['cpu']}, {info['threads']} threads",
        f"- torch {info['torch']}, transformers {info['transformers']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- command: `{info['command']}`", "",
        f"## Forward of T query tokens at context {args.context} (median of {args.repeats}, ms)", "",
        "specstack times include building the attention metadata; the tree is a fixed binary tree of T nodes.",
        "", forward_table(fwd, args.tokens),
    ]
    if gen is not None:
        parts += ["", f"## Greedy generation: {args.prompts} HumanEval prompts x {args.new_tokens} new tokens",
                  "", generation_table(gen, args.prompts)]
    return "\n".join(parts)


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
    fits_context(f"--context {s.context} + the widest --tokens {max(s.tokens)}", s.context + max(s.tokens),
                 first.config.max_seq_len)  # before any forward is timed
    tok, vocab = first.tokenizer, first.config.vocab_size
    hf_needed = [*s.hf_dtypes, *(["bf16"] if s.prompts > 0 else [])]  # bf16: the generation reference
    hf = {} if s.skip_hf else {d: load_hf(src, d) for d in dict.fromkeys(hf_needed)}

    # 1. forwards
    ctx = context_ids(tok, s.context, vocab)
    steps: dict[str, ForwardStep] = {}
    for lm in ours.values():
        steps |= forward_steps(lm, ctx, max(s.tokens))
    steps |= {f"hf {d}": hf_forward_step(hf[d], ctx) for d in s.hf_dtypes if d in hf}
    fwd = time_forwards(steps, s.tokens, vocab, s.repeats, s.warmup)

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
        llm = load_llama_cpp(src, s.threads, max(map(len, prompts)) + s.new_tokens + 8)
        if llm is not None:
            fns["llama.cpp"] = llama_cpp_generate_fn(llm)
        gen = run_generation(fns, prompts, s.new_tokens)

    print(render(info, s, fwd, gen))
    results = {"machine": info, "settings": asdict(s) | {"out": str(s.out)},
               "tree_parents": {t: tree_parents(t) for t in s.tokens},
               "forward": [asdict(r) for r in fwd], "generation": None if gen is None else [asdict(r) for r in gen]}
    atomic_write_text(s.out, json.dumps(results, indent=1) + "\n", parents=True)
    print(f"\nresults written to {s.out}", file=sys.stderr)
