"""The `specstack bench-forward` run: specstack's forward and greedy generation against transformers
(and llama.cpp if present). The protocol is the command's help (specstack/cli/bench_forward.py).

Terms: a forward step runs T query tokens at a fixed committed context and never commits (a
ForwardStep, engine/timing.py); part 1 times such steps per method and T, interleaved with the
method order rotated per repeat so machine drift cancels, for one row and for B rows (the batched
curve; with `ragged`, one row's prompt chunk beside B - 1 decoding rows in the PAD and SPLIT layouts);
part 2 times greedy generations of exactly new_tokens tokens, interleaved per prompt, against
transformers' bf16 `generate` (HF_GEN_REFERENCE). Beside them, each format's floor: the bytes a
one-token step reads at the machine's measured bandwidth (bench/bandwidth.py). The report: the JSON file; with B > 1 rows also a
markdown file beside it and, for two row counts or more, the curve as a figure (`report_paths`).
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
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specstack.attention import LAYOUTS, Layout
from specstack.bench.bandwidth import StepLimit, limit_table, measure_bandwidth, step_limits
from specstack.bench.datasets import humaneval_prompts
from specstack.bench.figures import pyplot, save_png
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
    rows: list[int]  # rows B per forward (1: one sequence, the classic forward)
    ragged: bool  # also time one row's prompt chunk beside B - 1 decoding rows, PAD vs SPLIT
    chunks: list[int]  # the prompt chunk's tokens C for `ragged`
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
    tokens: int  # T per row
    median_ms: float
    min_ms: float
    times_ms: list[float]
    rows: int = 1  # B rows of T tokens each


@dataclass
class RaggedRow:
    """One ragged forward: a row with a chunk of `chunk` tokens beside rows - 1 rows of one token
    (chunk 1: every row one token, the uniform decode step), in one layout."""

    method: str  # "specstack FORMAT"
    rows: int
    chunk: int
    layout: str
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
    """One row: methods x T."""
    rows = [r for r in rows if r.rows == 1]
    methods = list(dict.fromkeys(r.method for r in rows))
    ms = {(r.method, r.tokens): r.median_ms for r in rows}
    lines = ["| method | " + " | ".join(f"T = {t}" for t in token_counts) + " |",
             "|---|" + "---:|" * len(token_counts)]
    lines += [f"| {m} | " + " | ".join(f"{ms[m, t]:.1f}" for t in token_counts) + " |" for m in methods]
    return "\n".join(lines)


def rows_table(rows: Sequence[ForwardRow], method: str, row_counts: Sequence[int], token_counts: Sequence[int]) -> str:
    """One chain method: rows B x T -> ms, each with its ratio to one row of one token (when timed)."""
    ms = {(r.rows, r.tokens): r.median_ms for r in rows if r.method == method}
    base = ms.get((1, 1))

    def cell(b: int, t: int) -> str:
        v = ms.get((b, t))
        if v is None:
            return "–"
        return f"{v:.1f}" + (f" ({v / base:.2f}x)" if base else "")

    lines = ["| rows B | " + " | ".join(f"T = {t}" for t in token_counts) + " |",
             "|---:|" + "---:|" * len(token_counts)]
    lines += [f"| {b} | " + " | ".join(cell(b, t) for t in token_counts) + " |" for b in row_counts]
    return "\n".join(lines)


def _ragged_pairs(rows: Sequence[RaggedRow]) -> dict[tuple[str, int, int], dict[str, float]]:
    """(method, B, C) -> {layout: median ms}, in the rows' order."""
    pairs: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in rows:
        pairs.setdefault((r.method, r.rows, r.chunk), {})[r.layout] = r.median_ms
    return pairs


def _faster(ms: dict[str, float]) -> tuple[str, float]:
    """The faster layout and how many times faster it is."""
    fast, slow = sorted(LAYOUTS, key=lambda layout: ms[layout])
    return fast, ms[slow] / ms[fast]


def ragged_table(rows: Sequence[RaggedRow]) -> str:
    lines = ["| method | rows B | chunk C | pad ms | split ms | faster |", "|---|---:|---:|---:|---:|---|"]
    for (m, b, c), ms in _ragged_pairs(rows).items():
        fast, ratio = _faster(ms)
        chunk = f"{c} (uniform)" if c == 1 else str(c)
        lines.append(f"| {m} | {b} | {chunk} | {ms['pad']:.1f} | {ms['split']:.1f} | {fast} ({ratio:.2f}x) |")
    return "\n".join(lines)


def crossover_lines(rows: Sequence[RaggedRow]) -> list[str]:
    """Per method and B: the chunk sizes at which each layout was the faster."""
    wins: dict[tuple[str, int], dict[str, list[int]]] = {}
    for (m, b, c), ms in _ragged_pairs(rows).items():
        wins.setdefault((m, b), {layout: [] for layout in LAYOUTS})[_faster(ms)[0]].append(c)
    return [f"- {m}, B = {b}: " + "; ".join(f"{layout} faster at C = {', '.join(map(str, cs))}"
                                             for layout, cs in w.items() if cs) for (m, b), w in wins.items()]


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
           gen: Sequence[GenerationRow] | None, ragged: Sequence[RaggedRow] = (), notes: Sequence[str] = (),
           limits: Sequence[StepLimit] = ()) -> str:
    parts = [
        f"# Forward and generation benchmark: {args.model}", "",
        f"- CPU: {info['cpu']}, {info['threads']} threads",
        f"- torch {info['torch']}, transformers {info['transformers']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- command: `{info['command']}`",
        *(f"- {note}" for note in notes),
    ]
    if limits:
        t1 = {r.method.split()[1]: r.median_ms for r in fwd
              if r.rows == 1 and r.tokens == 1 and r.method.startswith("specstack ") and r.method.endswith(" chain")}
        parts += ["", "## The physical limit of a one-token step", "",
                  "Memory bandwidth: the best of 5 copies of 1 GiB (read + write). A step's bytes: the linear "
                  "layers' stored weights with their scales, and one embedding row.", "",
                  limit_table(list(limits), t1, info["bandwidth_gbs"] * 1e9)]
    if 1 in args.rows:
        parts += [
            "", f"## Forward of T query tokens at context {args.context} (median of {args.repeats}, ms)", "",
            "specstack times include building the attention metadata; the tree is a fixed binary tree of T nodes.",
            "", forward_table(fwd, args.tokens),
        ]
    if any(b > 1 for b in args.rows):
        parts += ["", f"## Batched forward: B rows x T tokens at context {args.context} (median of {args.repeats}, ms)",
                  "", "Every row holds the same committed context and continues it by a chain of T tokens (logits "
                  "for all); in brackets the time against one row of one token in the same format."]
        for m in dict.fromkeys(r.method for r in fwd if r.rows > 1):
            parts += ["", f"### {m}", "", rows_table(fwd, m, args.rows, args.tokens)]
    if ragged:
        parts += ["", f"## Ragged rows, PAD vs SPLIT (median of {args.repeats}, ms)", "",
                  "B - 1 decoding rows of one token and one joining row's prompt chunk of C tokens (C = 1: every "
                  "row one token), at context "
                  f"{args.context}; PAD runs tokens [B, C] padded and masked, SPLIT packs the C + B - 1 tokens "
                  "[1, C + B - 1] and attends per run of equal rows; logits of each row's last token.", "",
                  ragged_table(ragged), "", *crossover_lines(ragged)]
    if gen is not None:
        parts += ["", f"## Greedy generation: {args.prompts} HumanEval prompts x {args.new_tokens} new tokens",
                  "", generation_table(gen, args.prompts)]
    return "\n".join(parts)


def batched(row_counts: Sequence[int]) -> bool:
    """A run with B > 1 rows writes its report beside the JSON file (`report_paths`); a one-row run
    writes the JSON file alone, as before rows existed."""
    return max(row_counts) > 1


def report_paths(out: Path) -> tuple[Path, Path]:
    """The markdown report and the rows figure of a batched run, beside the JSON file: forward.json ->
    forward.md, forward_rows.png."""
    md = out.with_suffix(".md") if out.suffix != ".md" else out.with_name(out.name + ".md")
    return md, out.with_name(f"{out.stem}_rows.png")


def plot_rows(fwd: Sequence[ForwardRow], row_counts: Sequence[int], path: Path) -> None:
    """ms against B (log2 axis), one panel per chain method (format), one line per T."""
    plt = pyplot()
    methods = list(dict.fromkeys(r.method for r in fwd if r.rows > 1))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods) + 1, 4.2), squeeze=False)
    sizes = sorted(row_counts)
    for ax, m in zip(axes[0], methods, strict=True):
        lines: dict[int, list[tuple[int, float]]] = {}
        for r in fwd:
            if r.method == m:
                lines.setdefault(r.tokens, []).append((r.rows, r.median_ms))
        for t, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", ms=4, label=f"T = {t}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("rows B")
        ax.set_ylabel("ms per forward (median)")
        ax.set_title(m.removesuffix(" chain"))
        ax.legend(fontsize=8)
    fig.suptitle("Batched forward: B rows x T tokens")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_figure(fwd: Sequence[ForwardRow], row_counts: Sequence[int], path: Path) -> str | None:
    """The rows figure when there is a curve (two row counts or more); a note when it is not drawn."""
    path.unlink(missing_ok=True)  # never leave the figure of an earlier run beside this run's numbers
    if len(row_counts) < 2:
        return None
    try:
        plot_rows(fwd, row_counts, path)
    except ImportError:
        return "figure skipped: matplotlib is not installed (pip install matplotlib)"
    return f"figure: {path.name}"


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
    bandwidth = measure_bandwidth()
    limits = step_limits(ours, bandwidth)
    info["bandwidth_gbs"] = bandwidth / 1e9
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

    md, png = report_paths(s.out)
    results = {"machine": info, "settings": asdict(s) | {"out": str(s.out)},
               "tree_parents": {t: tree_parents(t) for t in s.tokens},
               "limits": [asdict(lim) for lim in limits], "forward": [asdict(r) for r in fwd], "ragged": [asdict(r) for r in ragged] if s.ragged else None,
               "generation": None if gen is None else [asdict(r) for r in gen]}
    atomic_write_text(s.out, json.dumps(results, indent=1) + "\n", parents=True)
    if not batched(s.rows):  # one row: the JSON file alone, as before rows existed
        print(render(info, s, fwd, gen, limits=limits))
        print(f"\nresults written to {s.out}", file=sys.stderr)
        return
    note = write_figure(fwd, s.rows, png)
    report = render(info, s, fwd, gen, ragged, [note] if note else [], limits)
    atomic_write_text(md, report + "\n")
    print(report)
    print(f"\nresults written to {s.out} and {md}" + (f" ({png.name} beside them)" if png.is_file() else ""),
          file=sys.stderr)
