"""Our one-token step against llama.cpp's on the same GGUF, paired: rounds of llama-bench's tg (a separate
process, `-n 16 -r 3` at the same context and threads) right before our step (in this process, the
median of 30 forwards), so the host's drifting bandwidth falls on both alike within a round. Prints each
round's ratio and the median of the rounds' ratios, per model; with --decoders, our step with the
blocks eager and native (models/native_decoder.py) in each round.

    python benchmarks/step_vs_llama.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from specstack.bench.llama_bench import LlamaBench, find
from specstack.engine.timing import forward_steps, random_context
from specstack.models import w4a8
from specstack.models.loading import load_model
from specstack.models.native_decoder import FORCE_ENV
from specstack.models.registry import resolve


def our_step(step, repeats: int) -> float:
    tok = torch.tensor([[5]])
    step(tok)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(tok)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decoders", action="store_true", help="time our step eager and native in each round")
    ap.add_argument("--llama-bin-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    binary, why = find(args.llama_bin_dir)
    if binary is None:
        raise SystemExit(f"specstack: error: {why}")
    print(f"w4a8 path: {w4a8.kernel_for(torch.device('cpu')).name}, {args.threads} threads, context {args.context}")
    modes = ("eager", "native") if args.decoders else ("default",)
    for name in args.models.split(","):
        lm = load_model(name, dtype="w4a8")
        step = forward_steps(lm, random_context(args.context, lm.model.config.vocab_size), 1)["specstack w4a8 chain"]
        peer = LlamaBench(binary, Path(resolve(name).path), (0,), args.context, args.threads, 3)  # -p 0: tg only
        ratios: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            tg = next(f.median_ms for f in peer.run() if f.kind == "tg")
            cells = []
            for mode in modes:
                if mode != "default":
                    os.environ[FORCE_ENV] = mode
                    lm.model._drop_native()
                ours = our_step(step, 30)
                ratios[mode].append(ours / tg)
                cells.append(f"{mode} {ours:.2f} ms ({ours / tg:.3f})")
            print(f"{name} round {r + 1}: llama.cpp tg {tg:.2f} ms, ours " + ", ".join(cells), flush=True)
        print(f"{name}: median of the rounds' ratios ours / llama.cpp: "
              + ", ".join(f"{m} {statistics.median(v):.3f}" for m, v in ratios.items()), flush=True)
    os.environ.pop(FORCE_ENV, None)


if __name__ == "__main__":
    main()
