"""The `specstack bench-forward` results and their report (bench/forward.py runs the bench): the settings
and row types as the results file records them, the markdown tables (forward per T, B rows x T, ragged
PAD vs SPLIT with the crossover, generation, the step's physical limit), and the rows figure."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstack.attention import LAYOUTS
from specstack.bench.bandwidth import StepLimit, limit_table
from specstack.bench.figures import pyplot, save_png
from specstack.bench.llama_bench import LlamaForward, comparison_table


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
    llama_bin_dir: Path | None = None  # where llama-bench is (None: found as llama-batched-bench is)
    skip_llama: bool = False  # no llama-bench


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
           limits: Sequence[StepLimit] = (), llama: Sequence[LlamaForward] = ()) -> str:
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
        read_gbs = info.get("read_bandwidth_gbs")
        parts += ["", "## The physical limit of a one-token step", "",
                  "Memory bandwidth: the best of 5 copies of 1 GiB (read + write), and of 5 sums over 1 GiB "
                  "(reads alone, as a step's weights are read). A step's bytes: the linear "
                  "layers' stored weights with their scales, and one embedding row.", "",
                  limit_table(list(limits), t1, info["bandwidth_gbs"] * 1e9,
                              None if read_gbs is None else read_gbs * 1e9)]
    if 1 in args.rows:
        parts += [
            "", f"## Forward of T query tokens at context {args.context} (median of {args.repeats}, ms)", "",
            "specstack times include building the attention metadata; the tree is a fixed binary tree of T nodes.",
            "", forward_table(fwd, args.tokens),
        ]
    if llama:
        ours = {r.method.split()[1]: {} for r in fwd if r.rows == 1 and r.method.endswith(" chain")}
        for r in fwd:
            if r.rows == 1 and r.method.endswith(" chain"):
                ours[r.method.split()[1]][r.tokens] = r.median_ms
        parts += ["", "## Beside llama.cpp (`llama-bench` on the same GGUF, same threads and context)", "",
                  "llama.cpp's T = 1 is its tg step (pp1 beside it), T > 1 its ppT; ours the chain forwards above "
                  "(llama.cpp's times exclude building a mask, ours include it).", "",
                  comparison_table(ours, llama, args.tokens)]
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
