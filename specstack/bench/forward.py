"""Benchmark: specstack's forward and greedy generation against transformers (and llama.cpp if present).

Part 1 (forward): for each weight format, prefill a context (default 256 tokens of HumanEval text),
then time forwards of T query tokens at that context, as a causal chain (`build_batch`) and as a
draft tree (`tree_batch`, a fixed binary tree of T nodes). Forwards never commit, so the cache's
committed length stays at the context and every repeat runs at the same context (cache.py: a
forward writes scratch slots only). The time includes building the attention metadata, as a decoding
step pays it (transformers builds its mask inside its forward too). Beside it, transformers' forward
of the same GGUF (bf16 and fp32) with a DynamicCache cropped back to the context after each forward.
All methods are measured interleaved (method order rotated per repeat) so machine drift cancels.

Part 2 (generation): greedy, exactly --new-tokens tokens (EOS ignored) on the first --prompts
HumanEval prompts, specstack's `generate` in every format beside transformers' `generate` (bf16),
interleaved per prompt; tokens/s, mean per-prompt speed-up vs transformers bf16, and how many outputs
are token-identical to transformers'.

    python -m specstack.bench.forward --formats int4 --tokens 1,4 --repeats 2 --prompts 1 --new-tokens 8
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import shlex
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
    HF_DTYPES,
    hf_generate,
    llama_cpp_generate,
    load_hf,
    load_llama_cpp,
)
from specstack.config import WEIGHT_FORMATS, GenerationConfig, SamplingParams
from specstack.engine.autoregressive import generate
from specstack.engine.timing import (
    ForwardStep,
    forward_steps,
    random_context,
    tree_parents,
)
from specstack.errors import SpecstackError
from specstack.machine import cpu_model, now, versions
from specstack.models.loading import LoadedModel, load_model
from specstack.models.registry import DEFAULT_MODEL, resolve

HF_GEN_REFERENCE = "hf bf16"  # the method speed-ups and token matches of part 2 are measured against

GenerateFn = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> new token ids


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
# Arguments
# ---------------------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, each once, in order."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def _format_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in WEIGHT_FORMATS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"formats must be among {', '.join(WEIGHT_FORMATS)}, got {text!r}")
    return values


def _hf_dtype_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if any(v not in HF_DTYPES for v in values):
        raise argparse.ArgumentTypeError(f"transformers dtypes must be among {', '.join(HF_DTYPES)}, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    p.add_argument("--formats", type=_format_list, default=list(WEIGHT_FORMATS), help="specstack weight formats")
    p.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="query tokens T per forward")
    p.add_argument("--context", type=int, default=256, help="committed context before the timed forwards")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per method and T (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per method and T")
    p.add_argument("--prompts", type=int, default=20, help="HumanEval prompts for generation (0: skip part 2)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads")
    p.add_argument("--hf-dtypes", type=_hf_dtype_list, default=["bf16", "fp32"],
                   help="transformers dtypes for the forward timings")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--out", type=Path, default=Path("docs/bench/forward.json"), help="JSON results file")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench-forward` on a CLI's subparsers; the parser's `func` is `run`."""
    p = subparsers.add_parser("bench-forward", help="time forwards and greedy generation vs transformers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in ("context", "repeats", "threads", "new_tokens"):
        if getattr(args, name) <= 0:
            raise SpecstackError(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.prompts < 0:
        raise SpecstackError("--warmup and --prompts must be >= 0")


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
        speedup = statistics.mean(r / s for r, s in zip(ref_s, secs))
        identical = None if name == HF_GEN_REFERENCE else sum(a == b for a, b in zip(outs, ref_o))
    return GenerationRow(name, total_tokens, total_s, total_tokens / total_s, speedup, identical, secs)


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    v = versions()
    return {
        "cpu": cpu_model(), "threads": args.threads, "torch": v["torch"], "transformers": v["transformers"],
        "python": v["python"], "date": now(), "command": command_line(args),
    }


def command_line(args: argparse.Namespace) -> str:
    given = getattr(args, "argv", None)
    if given is not None:
        return shlex.join(["python", "-m", "specstack.bench.forward", *given])
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


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


def render(info: dict[str, Any], args: argparse.Namespace, fwd: Sequence[ForwardRow],
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
# Entry points
# ---------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    _check_args(args)
    torch.set_num_threads(args.threads)
    src = resolve(args.model)
    info = machine_info(args)

    ours = {fmt: load_model(args.model, dtype=fmt) for fmt in args.formats}
    first = ours[args.formats[0]]
    tok, vocab = first.tokenizer, first.config.vocab_size
    hf_needed = [*args.hf_dtypes, *(["bf16"] if args.prompts > 0 else [])]  # bf16: the generation reference
    hf = {} if args.skip_hf else {d: load_hf(src, d) for d in dict.fromkeys(hf_needed)}

    ctx = context_ids(tok, args.context, vocab)
    steps: dict[str, ForwardStep] = {}
    for lm in ours.values():
        steps |= forward_steps(lm, ctx, max(args.tokens))
    steps |= {f"hf {d}": hf_forward_step(hf[d], ctx) for d in args.hf_dtypes if d in hf}
    fwd = time_forwards(steps, args.tokens, vocab, args.repeats, args.warmup)

    gen: list[GenerationRow] | None = None
    if args.prompts > 0:
        if tok is None:
            raise SpecstackError("generation needs a tokenizer; pass --prompts 0 to skip it")
        prompts = [list(tok(p, add_special_tokens=True).input_ids) for p in humaneval_prompts(args.prompts)]
        fns = {f"specstack {fmt}": ours_generate_fn(lm) for fmt, lm in ours.items()}
        if hf:
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            fns[HF_GEN_REFERENCE] = hf_generate_fn(hf["bf16"], pad)
        llm = load_llama_cpp(src, args.threads, max(map(len, prompts)) + args.new_tokens + 8)
        if llm is not None:
            fns["llama.cpp"] = llama_cpp_generate_fn(llm)
        gen = run_generation(fns, prompts, args.new_tokens)

    print(render(info, args, fwd, gen))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("func", "argv")}
    results = {"machine": info, "settings": settings,
               "tree_parents": {t: tree_parents(t) for t in args.tokens},
               "forward": [asdict(r) for r in fwd], "generation": None if gen is None else [asdict(r) for r in gen]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nresults written to {args.out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specstack.bench.forward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return run(args)
    except SpecstackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
