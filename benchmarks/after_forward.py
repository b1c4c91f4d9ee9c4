"""What small operations cost right after a one-token forward, against the same operation run again at
once (warm): the part of a step's bookkeeping that is the forward's doing, not the bookkeeping's.

A forward streams all the weights through the caches (far more than L3 holds), so whatever runs next
finds its code and data evicted: the engine's first microseconds of Python and torch after every
forward run at the memory's latency. Each probe runs after its own forward, alternating, median of the
repeats, microseconds:

    python benchmarks/after_forward.py --model smollm2-135m --repeats 40
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from specstack.attention import build_batch
from specstack.models.loading import load_model
from specstack.sampling import argmax_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="w4a8")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, tokenizer=False).model
    cache = model.new_cache(1, 64)
    ids = torch.randint(0, 1000, (1, 1))
    small, arr = torch.ones(4), np.random.default_rng(0).random(1000, dtype=np.float32)
    other = torch.randn(1, model.config.vocab_size)

    def forward() -> torch.Tensor:
        out = model.forward(ids, build_batch(cache, 1), cache)
        cache.scratch = 0  # the next forward rewrites the same slot
        return out.logits.reshape(1, -1)

    probes: dict[str, Callable[[torch.Tensor], object]] = {
        "argmax of the logits (NumPy)": argmax_rows,
        "argmax of another row": lambda logits: argmax_rows(other),
        "a new tensor, one add": lambda logits: torch.ones(4).add_(1),
        "an add in place": lambda logits: small.add_(1),
        "NumPy argmax of 1,000": lambda logits: arr.argmax(),
        "a Python loop of 200": lambda logits: sum(range(200)),
    }
    after: dict[str, list[float]] = {k: [] for k in probes}
    again: dict[str, list[float]] = {k: [] for k in probes}
    steps: list[float] = []
    for _ in range(args.repeats):
        for name, probe in probes.items():
            t0 = time.perf_counter()
            logits = forward()
            t1 = time.perf_counter()
            probe(logits)
            t2 = time.perf_counter()
            probe(logits)
            t3 = time.perf_counter()
            steps.append(t1 - t0)
            after[name].append(t2 - t1)
            again[name].append(t3 - t2)
    print(f"{args.model} ({args.dtype}, {args.threads} threads): forward {1e3 * statistics.median(steps):.2f} ms")
    print(f"{'probe':32s} {'after a forward':>16s} {'again':>8s}  (µs, median of {args.repeats})")
    for name in probes:
        print(f"{name:32s} {1e6 * statistics.median(after[name]):16.1f} {1e6 * statistics.median(again[name]):8.1f}")


if __name__ == "__main__":
    main()
