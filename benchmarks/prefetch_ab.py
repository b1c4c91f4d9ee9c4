"""A/B of the w4a8 kernels' software prefetch distance (models/kernels/w4a8.cpp, `set_prefetch`) in whole
one-token steps of real models, in one process: the distances interleaved round by round (the order
reversed every other round) so the host's drifting bandwidth falls on all of them alike; medians, and
each as a ratio to the first distance given.

    python benchmarks/prefetch_ab.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --distances 0,2048,8192
    SPECSTACK_W4A8_KERNEL=avx2 python benchmarks/prefetch_ab.py --models qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import time

import torch

from specstack.engine.timing import forward_steps, random_context
from specstack.models import w4a8
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--distances", default="0,2048,4096,8192,16384", help="bytes ahead; the first is the base")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    distances = [int(d) for d in args.distances.split(",")]
    w4a8.kernel_for(torch.device("cpu"))  # builds and loads the library
    default = torch.ops.specstack_w4a8.set_prefetch(distances[0])
    path = w4a8.kernel_for(torch.device("cpu")).name
    print(f"w4a8 path: {path}, {args.threads} threads")
    for name in args.models.split(","):
        lm = load_model(name, dtype="w4a8")
        step = forward_steps(lm, random_context(256, lm.model.config.vocab_size), 1)["specstack w4a8 chain"]
        tok = torch.tensor([[5]])
        for _ in range(5):
            step(tok)
        times: dict[int, list[float]] = {d: [] for d in distances}
        for r in range(args.rounds):
            for d in distances if r % 2 == 0 else distances[::-1]:
                torch.ops.specstack_w4a8.set_prefetch(d)
                step(tok)  # one untimed step after a switch
                for _ in range(3):
                    t0 = time.perf_counter()
                    step(tok)
                    times[d].append(time.perf_counter() - t0)
        med = {d: sorted(v)[len(v) // 2] for d, v in times.items()}
        print(f"{name}: " + "  ".join(f"{d} B: {1e3 * med[d]:.2f} ms ({med[d] / med[distances[0]]:.3f})"
                                     for d in distances))
    torch.ops.specstack_w4a8.set_prefetch(default)


if __name__ == "__main__":
    main()
