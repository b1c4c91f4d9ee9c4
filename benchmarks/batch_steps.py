"""Where a batch's time goes, step by step: B rows of HumanEval prompts decoded by the batched engine with
each method, every target forward timed by its shape (rows, tokens) beside the cost curve's price of it
(engine/batch_cost.py, what the cost-aware rule decides by), every draft-model forward by its shape too,
and, for a cost-aware method, the acceptance its rule predicted for the nodes it kept against what the
target accepted. Decode steps only (at most 4 tokens a row, or 16 in all); medians. One row is a single sequence.

    python benchmarks/batch_steps.py --rows 4 --methods "ar;auto"
    python benchmarks/batch_steps.py --rows 1 --prompts 4 --methods "ar;chain:k=4"
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch

from specstack.bench.batched import method_batch_runner
from specstack.bench.datasets import humaneval_prompts
from specstack.config import GenerationConfig
from specstack.drafting import batch_length
from specstack.engine.draft_sources import DraftSources
from specstack.engine.methods import forward_cost, parse_method
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of methods that take one")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="HumanEval prompts, in batches of --rows")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--methods", default="ar;auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="w4a8")
    prompts = [lm.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    sources = DraftSources.for_model(lm.name, args.draft)
    price = forward_cost(lm, args.rows)
    timed: dict[tuple[str, int, int], list[float]] = collections.defaultdict(list)
    kept = {"predicted": 0.0, "nodes": 0, "accepted": 0}

    model_type = type(lm.model)
    forward = model_type.forward

    def timed_forward(self: Any, tokens: torch.Tensor, batch: Any, cache: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(self, tokens, batch, cache, *a, **k)
        rows, n = sum(1 for c in batch.n_valid if c), sum(batch.n_valid)
        if n <= max(4 * rows, 16):  # not a prompt chunk
            timed[("target" if self is lm.model else "draft", rows, n)].append(time.perf_counter() - t0)
        return out

    choose, observe = batch_length.CostAwareLength.choose, batch_length.CostAwareLength.observe

    def counted_choose(self: Any, trees: Any, rows: int, tokens: int) -> list[int]:
        keep = choose(self, trees, rows, tokens)
        kept["predicted"] += sum(sum((self.gains(t) or [])[:k]) for t, k in zip(trees, keep, strict=True))
        kept["nodes"] += sum(keep)
        return keep

    def counted_observe(self: Any, trees: Any, accepted: Any) -> None:
        kept["accepted"] += sum(a for t, a in zip(trees, accepted, strict=True) if len(t))
        return observe(self, trees, accepted)

    model_type.forward = timed_forward  # type: ignore[method-assign]
    batch_length.CostAwareLength.choose = counted_choose  # type: ignore[method-assign]
    batch_length.CostAwareLength.observe = counted_observe  # type: ignore[method-assign]
    sampling = GenerationConfig().sampling
    for name in [m.strip() for m in args.methods.split(";") if m.strip()]:
        run = method_batch_runner(lm, parse_method(name), sources, sampling)
        run(prompts[: args.rows], 8)  # warm-up
        timed.clear()
        kept.update(predicted=0.0, nodes=0, accepted=0)
        seconds = sum(run(prompts[i : i + args.rows], args.new).seconds for i in range(0, len(prompts), args.rows))
        print(f"{name} at B = {args.rows}: {seconds:.2f} s, {len(prompts) * args.new / seconds:.1f} tokens/s")
        if kept["nodes"]:
            print(f"  kept draft nodes {kept['nodes']}: predicted to be accepted {kept['predicted']:.1f}, "
                  f"accepted {kept['accepted']}")
        for (which, rows, n), times in sorted(timed.items(), key=lambda kv: (kv[0][0] != "target", kv[0])):
            curve = f" (the cost curve: {price(rows, n) * 1e3:.1f} ms)" if which == "target" else ""
            print(f"  {which} forward of {rows} rows, {n} tokens: {len(times)} x "
                  f"{statistics.median(times) * 1e3:.1f} ms{curve}")
    model_type.forward = forward  # type: ignore[method-assign]
    batch_length.CostAwareLength.choose = choose  # type: ignore[method-assign]
    batch_length.CostAwareLength.observe = observe  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
