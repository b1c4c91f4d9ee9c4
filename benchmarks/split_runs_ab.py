"""Serving, "Fragmented attention calls": one SPLIT forward whose rows verify drafts of random sizes 1..4,
with short blocks padded into one attention call (attention.PAD_RUN_TOKENS = 4, the engine's) against one
call per run of equal rows (PAD_RUN_TOKENS = 0, as before), interleaved in one process; median ms.

    python benchmarks/split_runs_ab.py [--rows 8,16,32] [--context 260] [--repeats 12] [--dtype int4]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch

import specstack.attention as attention
from specstack.attention import row_blocks_batch
from specstack.models.loading import load_model


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--rows", default="8,16,32")
    ap.add_argument("--context", type=int, default=260, help="committed tokens per row")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype)
    model, rnd = lm.model, random.Random(args.seed)
    print("| rows | block sizes (first 12) | one call per run of equal rows | short blocks padded | runs before |")
    print("|---:|---|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        cache = model.new_cache(0, args.context + 64, max_rows=rows)
        for _ in range(rows):
            cache.add_row()
        prompt = row_blocks_batch(cache, [list(range(-1, args.context - 1))] * rows, "pad")
        model.forward(torch.randint(0, 1000, (rows, args.context)), prompt, cache, logit_rows=slice(0, 0))
        for r in range(rows):
            cache.commit_nodes(r, list(range(args.context)))
        counts = [rnd.choice([1, 1, 2, 3, 4]) for _ in range(rows)]
        parents = [[-1, *range(c - 1)] for c in counts]
        times: dict[int, list[float]] = {0: [], 4: []}
        for _ in range(args.repeats):
            for pad in times:  # interleaved: drift hits both alike
                attention.PAD_RUN_TOKENS = pad
                batch = row_blocks_batch(cache, parents, "split")
                ids = torch.randint(0, 1000, (1, sum(counts)))
                t = time.perf_counter()
                model.forward(ids, batch, cache, logit_rows=slice(0, 0))
                times[pad].append(time.perf_counter() - t)
        runs = sum(1 for i in range(rows) if i == 0 or counts[i] != counts[i - 1])
        print(f"| {rows} | {counts[:12]} | {statistics.median(times[0]) * 1e3:.1f} ms | "
              f"{statistics.median(times[4]) * 1e3:.1f} ms | {runs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
