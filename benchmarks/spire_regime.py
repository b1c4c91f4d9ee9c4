"""SPIRe's regime (issues: BASS item 6; SPIRe where it lives): decode throughput of batched `ar` and of
draft-model chains over batch B x context L, where a step reads the KV cache more than the weights,
beside what the throughput model predicts for the same B, L and the τ each cell measured.

For each cell and method, B rows run in one BatchEngine: every row's prompt is read first (chunked
prefill, not timed), then the decode steps are timed until every row has N new tokens. Methods take
turns inside a cell, the order rotated each repeat. Per method and cell: decode tokens/s over all
rows, its multiplier over `ar` in the same cell, τ (tokens a row gains per round), draft tokens
verified per row step and the share accepted, and the engine's phases. With --hardware (a calibration
from `specstack throughput-calibrate`), the model's multiplier for the same B, L, k and measured τ.
JSON, markdown and one heat map per method (measured beside predicted) go to --out. (Rows with a
drafter read their root with their first tree, so the decode window starts a step later for them:
compare rates, not token counts.)

Prompts: --prompts FILE.jsonl (benchmarks/long_context_prompts.py; one context, the file's) or
--sequences FILE (a `train-draft --sequences` file: the first B held-out rows, each cut to L - N/2
tokens, so that the mean context while decoding is L).

Methods: `;`-separated, each `[LABEL=]METHOD[@DRAFT]`, DRAFT as --draft takes it (a draft file,
a model, magicdec:W, default), else --draft:

    python benchmarks/spire_regime.py --prompts bench_out/long1024.jsonl --batch 16 --new 64 \\
        --methods "ar;chain:k=2;chain:k=2,cost=1" --draft default --out bench_out/spire_regime_b16
    python benchmarks/spire_regime.py --model qwen2.5-coder-1.5b --sequences seq2048.safetensors \\
        --batch 1,4,16 --context 256,1024,2048 --new 32 --hardware calibration.json \\
        --methods "ar;spire=chain:k=3@spire/draft.safetensors;0.5b=chain:k=3@qwen2.5-coder-0.5b" \\
        --out bench_out/regime
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specstack.bench.datasets import read_jsonl
from specstack.config import DEFAULT_STEP_TOKENS, GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.methods import (
    DraftSources,
    MethodSpec,
    describe,
    drafter_factory,
    length_rule,
    parse_method,
)
from specstack.models.loading import LoadedModel, load_model


@dataclass
class Method:
    label: str
    spec: MethodSpec
    draft: str | None

    @property
    def drafting(self) -> bool:
        return self.spec.name != "ar"

    @property
    def k(self) -> int:
        return int(self.spec.params.get("k") or 0)


def parse_methods(text: str, default_draft: str | None) -> list[Method]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        label, eq, rest = item.partition("=")
        if not eq or ":" in label or "@" in label:  # no label: `chain:k=2` has its own `=` after the colon
            label, rest = "", item
        method, at, draft = rest.partition("@")
        spec = parse_method(method)
        out.append(Method(label or describe(spec), spec, draft if at else default_draft))
    return out


def emitted(engine: BatchEngine) -> int:
    return sum(len(r.stream.tokens) for r in engine.rows)


def run(lm: LoadedModel, m: Method, prompts: list[list[int]], new: int) -> dict:
    """One method on one cell: the steps in which all B rows decode, until they have `new` tokens a row
    on average. Rows read their prompts a chunk a step (one token budget), so the first rows decode
    while the last still read theirs: the timed window opens once every row has its first token, and
    each row may make enough tokens that none finishes inside it (the engine is then dropped).
    Its drafters are made for this run and dropped after it: a chain group's draft cache keeps a row
    per drafter it made (grown to what the row read), and two methods' drafts at B = 32 need not share
    the machine's memory."""
    rows = len(prompts)
    # steps the prompts take to read, at most (every decoding row's root takes a token of each step's budget)
    spread = sum(map(len, prompts)) // max(1, DEFAULT_STEP_TOKENS - rows) + 1
    most = (spread + new) * (m.k + 1) + 1  # what one row could make before and inside the window
    make = drafter_factory(m.spec, lm, DraftSources.for_model(lm.name, m.draft)) if m.drafting else None
    engine = BatchEngine(lm, max_rows=rows, max_context=max(map(len, prompts)) + most + 8,
                         length=length_rule(m.spec, lm, rows), drafters=make)
    gen = GenerationConfig(max_new_tokens=most, stop_on_eos=False)
    for p in prompts:
        engine.add(BatchRequest(p, gen))
    # prefill: until every row has emitted its first token (not timed)
    while any(not r.stream.tokens for r in engine.rows) or engine.waiting:
        engine.step()

    emitted0 = emitted(engine)
    st = engine.stats
    steps0, drafted0, accepted0, rows0 = st.steps, st.drafted, st.accepted, st.rows
    verified0, phases0 = st.verified, st.phase_seconds()
    t0 = time.perf_counter()
    while emitted(engine) - emitted0 < rows * new:
        if len(engine.rows) < rows:
            raise RuntimeError(f"a row finished inside the timed window ({most} tokens were not enough)")
        engine.step()
    seconds = time.perf_counter() - t0
    tokens = emitted(engine) - emitted0
    row_steps = st.rows - rows0
    phases = {k: v - phases0[k] for k, v in st.phase_seconds().items()}
    out = {"method": m.label, "spec": describe(m.spec), "draft": m.draft, "rows": rows, "decode_tokens": tokens,
           "decode_seconds": seconds, "tokens_per_s": tokens / seconds, "steps": st.steps - steps0,
           "drafted_per_row_step": (st.drafted - drafted0) / max(1, row_steps),
           "accepted": st.accepted - accepted0, "drafted": st.drafted - drafted0, "phases": phases,
           "rounds": st.verified - verified0,
           "context": statistics.mean(len(p) for p in prompts) + new / 2}
    del engine, make
    gc.collect()
    return out


def prompt_sets(lm: LoadedModel, args: argparse.Namespace) -> dict[tuple[int, int], list[list[int]]]:
    """(B, L) -> B prompts."""
    if args.prompts is not None:
        texts = [lm.tokenizer.encode(p.text) for p in read_jsonl(args.prompts)]
        return {(b, 0): texts[:b] for b in args.batch}
    from specstack.training.data import read_sequences

    (held,) = read_sequences(args.sequences, ("heldout",))
    need = max(args.batch)
    if len(held) < need or held.shape[1] < max(args.context):
        sys.exit(f"{args.sequences}: {len(held)} held-out rows of {held.shape[1]} tokens; need {need} of "
                 f"{max(args.context)}")
    return {(b, n): [row[: n - args.new // 2].tolist() for row in held[:b]] for b in args.batch for n in args.context}


def round_tau(m: Method, rows: list[dict]) -> float:
    """τ, tokens a row gains per round: the window's tokens over its verifications (the engine's
    BatchStats), every round counted, those a length rule drafted fewer nodes for, or none; 1 for `ar`.
    Rows written before the engine counted rounds: 1 + k · accepted / drafted, which overstates τ under
    a length rule (drafted / k undercounts its rounds)."""
    if all("rounds" in r for r in rows):
        rounds = sum(r["rounds"] for r in rows)
        return sum(r["decode_tokens"] for r in rows) / rounds if rounds else 1.0
    drafted = sum(r["drafted"] for r in rows)
    return 1.0 + m.k * sum(r["accepted"] for r in rows) / drafted if m.k and drafted else 1.0


def drafted_per_round(m: Method, rows: list[dict]) -> float:
    """Draft tokens a round verified (k for a chain every round of which drafts k; fewer under a length
    rule); k for rows written before the engine counted rounds."""
    rounds = sum(r["rounds"] for r in rows) if all("rounds" in r for r in rows) else 0
    return sum(r["drafted"] for r in rows) / rounds if rounds else float(m.k)


def predict(lm: LoadedModel, m: Method, hardware: Any, batch: int, context: int, tau: float,
            drafted: float) -> float | None:
    """The throughput model's multiplier for this method's draft at (B, L) with the τ the run measured and
    `drafted` draft tokens a round (a length rule's fractional mean: Δt interpolated between the rounds of
    the whole numbers around it)."""
    from specstack.models.drafts import DraftKind, DraftSpec
    from specstack.throughput.model import Draft, magicdec_draft, round_times, vanilla_draft
    from specstack.throughput.shapes import from_config, model_shape, trained_draft_shape

    k = m.k
    if not k:
        return None
    target = from_config(lm.config, lm.name, lm.fmt)
    spec = DraftSpec.parse(m.draft or "default").resolved(lm.name)
    if spec.kind == DraftKind.MAGICDEC:
        draft = magicdec_draft(target, spec.size + 1)
    elif spec.kind == DraftKind.FILE:
        from specstack.models.draft_file import read_draft_header

        shape = trained_draft_shape(spec.source, target)
        spire = bool(read_draft_header(spec.source).config.target_layers)
        draft = Draft("spire" if spire else "vanilla", shape, memory_projection=spire)
    elif spec.kind == DraftKind.MODEL:
        draft = vanilla_draft(model_shape(spec.source, "int4"))
    elif spec.kind == DraftKind.SELF:
        draft = vanilla_draft(target.first_layers(spec.size, name=str(spec)).in_format("int4"))
    else:
        return None
    lo = min(k, int(drafted))
    hi, w = min(k, lo + 1), drafted - lo
    dt = [round_times(target, draft, hardware, batch, int(context), j).delta_t for j in (lo, hi)]
    return min(max(tau, 1.0), drafted + 1) / ((1 - w) * dt[0] + w * dt[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4", help="the target's weight format (default int4)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", type=Path, help="a JSONL prompt set (its own context)")
    src.add_argument("--sequences", type=Path, help="a `train-draft --sequences` file (held-out rows)")
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[16])
    ap.add_argument("--context", type=lambda s: [int(x) for x in s.split(",")], default=[1024],
                    help="mean decode contexts (with --sequences)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--methods", default="ar;chain:k=2;chain:k=2,cost=1")
    ap.add_argument("--draft", default=None, help="the draft of methods that name none")
    ap.add_argument("--hardware", default=None, help="a throughput-calibrate file: predict each cell")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: summarise --out's rows.json again (e.g. with a --hardware made after the run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype)
    hardware = None
    if args.hardware:
        from specstack.throughput.hardware import load_hardware

        hardware = load_hardware(args.hardware)
    if args.summarize:
        summary(lm, parse_methods(args.methods, args.draft), json.loads((args.out / "rows.json").read_text()), args,
                hardware)
        return
    cells = prompt_sets(lm, args)
    methods = parse_methods(args.methods, args.draft)
    warm = next(iter(cells.values()))
    for m in methods:  # warm-up (and the batch cost curves, once)
        run(lm, m, [p[:128] for p in warm[: min(4, len(warm))]], 8)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")  # a cell's multipliers are over `ar` of the same run
    for (b, _n), prompts in cells.items():
        for r in range(args.repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                row = run(lm, m, prompts, args.new) | {"repeat": r, "batch": b, "run": run_id}
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k != "phases"}), flush=True)
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    summary(lm, methods, rows, args, hardware)


def summary(lm: LoadedModel, methods: list[Method], rows: list[dict], args: argparse.Namespace, hardware: Any) -> None:
    cells = sorted({(r["batch"], round(r["context"])) for r in rows})
    lines = [f"{lm.name} ({lm.fmt}), {args.new} new tokens a row, {args.threads} threads, median of {args.repeats}; "
             "x ar: decode tokens/s over `ar`'s in the same cell; predicted: the throughput model with "
             f"{args.hardware or 'no hardware file'} at the cell's B, L and measured τ", "",
             "| B | context | method | decode tokens/s | x ar | predicted | τ | draft tokens a row step | "
             "accepted of drafted | draft / target / verify / overhead s |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    grid: dict[str, dict[tuple[int, int], tuple[float, float | None]]] = {}
    for b, n in cells:
        here = [r for r in rows if r["batch"] == b and round(r["context"]) == n]
        for m in methods:
            mine = [r for r in here if r["method"] == m.label]
            if not mine:
                continue
            # `ar` of the runs this method's rows come from (rows merged from several runs keep their own)
            runs = {r.get("run") for r in mine}
            base = [r["tokens_per_s"] for r in here if r["method"] == "ar" and r.get("run") in runs]
            tps = statistics.median(r["tokens_per_s"] for r in mine)
            tau = round_tau(m, mine)
            x = tps / statistics.median(base) if base else None
            pred = predict(lm, m, hardware, b, n, tau, drafted_per_round(m, mine)) if hardware is not None else None
            if m.k and x is not None:
                grid.setdefault(m.label, {})[(b, n)] = (x, pred)
            ph = mine[0]["phases"]
            share = sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine))
            lines.append(f"| {b} | {n} | {m.label} | {tps:.1f} | {'' if x is None else f'{x:.2f}'} | "
                         f"{'' if pred is None else f'{pred:.2f}'} | {tau:.2f} | "
                         f"{statistics.median(r['drafted_per_row_step'] for r in mine):.2f} | {share:.0%} | "
                         f"{ph['draft']:.1f} / {ph['target']:.1f} / {ph['verify']:.1f} / {ph['overhead']:.1f} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    if grid:
        heatmaps(grid, args.out / "regime.png")


def heatmaps(grid: dict[str, dict[tuple[int, int], tuple[float, float | None]]], path: Path) -> None:
    """Per method: the measured multiplier over (B, L), and beside it the predicted one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for g in grid.values() for b, _ in g})
    contexts = sorted({n for g in grid.values() for _, n in g})
    fig, axes = plt.subplots(len(grid), 2, figsize=(2.2 + 1.1 * len(contexts) * 2, 1.2 + 0.9 * len(batches) * len(grid)),
                             squeeze=False)
    for row, (label, g) in enumerate(grid.items()):
        for col, which in enumerate(("measured", "predicted")):
            ax = axes[row][col]
            vals = [[(g.get((b, n)) or (None, None))[col] for n in contexts] for b in batches]
            data = [[float("nan") if v is None else v for v in line] for line in vals]
            ax.imshow(data, cmap="RdYlGn", vmin=0.0, vmax=2.0, aspect="auto")
            for i, line in enumerate(vals):
                for j, v in enumerate(line):
                    ax.text(j, i, "–" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=9)
            ax.set_xticks(range(len(contexts)), [str(n) for n in contexts])
            ax.set_yticks(range(len(batches)), [str(b) for b in batches])
            ax.set_xlabel("context")
            ax.set_ylabel("batch")
            ax.set_title(f"{label}: {which} x ar", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"heat map -> {path}")


if __name__ == "__main__":
    main()
