"""Batched `ar` against a speculative method on one batch, alternating in one process: B HumanEval prompts
decoded as one batch by each, in turns (ABBA...), so the host's drifting pace falls on both alike; each
turn prints its wall time, engine steps, layouts and phases, and the end the per-round ratios (the
method's tokens/s over `ar`'s) and their median. `specstack bench --batch-sizes` measures the same with
its rotation over batches; this one takes many rounds of a single batch, for ratios near 1.

    python benchmarks/batch_alternate.py --rows 32 --rounds 6 --method auto
"""
from __future__ import annotations

import argparse
import statistics

import torch

from specstack.bench.batched import BatchRunner, method_batch_runner
from specstack.bench.datasets import humaneval_prompts
from specstack.config import GenerationConfig
from specstack.engine.draft_sources import DraftSources
from specstack.engine.methods import parse_method
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of a method that takes one")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="w4a8")
    prompts = [lm.tokenizer.encode(p) for p in humaneval_prompts(args.rows)]
    sources = DraftSources.for_model(lm.name, args.draft)
    sampling = GenerationConfig().sampling
    runs: dict[str, BatchRunner] = {name: method_batch_runner(lm, parse_method(name), sources, sampling)
                                    for name in ("ar", args.method)}
    for run in runs.values():
        run(prompts, 8)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            out = runs[name](prompts, args.new)
            seconds[name].append(out.seconds)
            phases = {k: round(v, 2) for k, v in (out.phases or {}).items()}
            print(f"round {r} {name}: {out.seconds:.2f} s, {out.steps} steps {out.layouts}, phases {phases}", flush=True)
    ratios = [a / m for a, m in zip(seconds["ar"], seconds[args.method], strict=True)]
    print(f"{args.method} / ar tokens/s at B = {args.rows}, per round: {[round(x, 3) for x in ratios]}, "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
