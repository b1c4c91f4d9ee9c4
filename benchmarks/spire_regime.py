"""SPIRe's regime (issue: BASS, item 6): decode throughput of batched `ar` and of draft-model chains
at large batch and long context, where a step reads the KV cache more than the weights.

For each method, B rows of long prompts (benchmarks/long_context_prompts.py) run in one BatchEngine:
every row's prompt is read first (chunked prefill, not timed), then the decode steps are timed until
every row has N new tokens. Methods take turns, the order rotated each repeat. Per method: decode
tokens/s over all rows, draft tokens verified per row step and the share of them accepted, and the
engine's phases. JSON and markdown go to --out. (Rows with a drafter read their root with their first
tree, so the decode window starts a step later for them: compare rates, not token counts.)

    python benchmarks/spire_regime.py --prompts bench_out/long1024.jsonl --batch 16 --new 64 \\
        --methods "ar;chain:k=2;chain:k=2,cost=1" --draft default --out bench_out/spire_regime_b16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specstack.bench.datasets import read_jsonl
from specstack.config import GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.methods import DraftSources, describe, drafter_factory, length_rule, parse_method
from specstack.models.loading import load_model


def run(lm, method, make, prompts, new: int) -> dict:
    rows = len(prompts)
    engine = BatchEngine(lm, max_rows=rows, max_context=max(map(len, prompts)) + new + 8,
                         length=length_rule(method, lm, rows), drafters=make)
    gen = GenerationConfig(max_new_tokens=new, stop_on_eos=False)
    handles = [engine.add(BatchRequest(p, gen)) for p in prompts]
    # prefill: until every row has emitted its first token (not timed)
    while any(not r.stream.tokens for r in engine.rows) or engine.waiting:
        engine.step()
    emitted0 = sum(len(r.stream.tokens) for r in engine.rows)
    steps0, drafted0, accepted0, rows0 = engine.stats.steps, engine.stats.drafted, engine.stats.accepted, engine.stats.rows
    phases0 = engine.stats.phase_seconds()
    t0 = time.perf_counter()
    while engine.busy:
        engine.step()
    seconds = time.perf_counter() - t0
    results = [engine.pop_result(h) for h in handles]
    st = engine.stats
    tokens = sum(len(r.tokens) for r in results) - emitted0
    steps = st.steps - steps0
    row_steps = st.rows - rows0
    phases = {k: v - phases0[k] for k, v in st.phase_seconds().items()}
    return {"method": describe(method), "rows": rows, "decode_tokens": tokens, "decode_seconds": seconds,
            "tokens_per_s": tokens / seconds, "steps": steps,
            "drafted_per_row_step": (st.drafted - drafted0) / max(1, row_steps),
            "accepted": st.accepted - accepted0, "drafted": st.drafted - drafted0, "phases": phases,
            "context": statistics.mean(len(p) for p in prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--methods", default="ar;chain:k=2;chain:k=2,cost=1")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m")
    prompts = [lm.tokenizer.encode(p.text) for p in read_jsonl(args.prompts)][: args.batch]
    methods = [parse_method(m) for m in args.methods.split(";")]
    sources = DraftSources.for_model(lm.name, args.draft)
    makes = [drafter_factory(m, lm, sources) for m in methods]
    for m, make in zip(methods, makes, strict=True):  # warm-up (and the batch cost curves, once)
        run(lm, m, make, prompts[: min(4, len(prompts))], 8)
    rows = []
    for r in range(args.repeats):
        order = list(range(len(methods)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            row = run(lm, methods[i], makes[i], prompts, args.new) | {"repeat": r, "draft": args.draft or "default"}
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                              if k != "phases"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    base = statistics.median(r["tokens_per_s"] for r in rows if r["method"] == "ar") if any(
        r["method"] == "ar" for r in rows) else None
    lines = [f"B = {len(prompts)}, context {rows[0]['context']:.0f} tokens, {args.new} new tokens a row, draft "
             f"{args.draft or 'default'}, {args.threads} threads, median of {args.repeats}", "",
             "| method | decode tokens/s | x ar | draft tokens a row step | accepted of drafted | "
             "draft / target / verify / overhead s |",
             "|---|---:|---:|---:|---:|---|"]
    for m in methods:
        mine = [r for r in rows if r["method"] == describe(m)]
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        ph = mine[0]["phases"]
        share = sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine))
        lines.append(f"| {describe(m)} | {tps:.1f} | {tps / base:.2f} | "
                     f"{statistics.median(r['drafted_per_row_step'] for r in mine):.2f} | {share:.0%} | "
                     f"{ph['draft']:.1f} / {ph['target']:.1f} / {ph['verify']:.1f} / {ph['overhead']:.1f} |"
                     if base else f"| {describe(m)} | {tps:.1f} | | | | |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
