"""A/B of the decoder's blocks run natively in one call (models/native_decoder.py) against the eager
blocks, in whole forwards of T tokens (chains) of real models in w4a8, in one process: the two
interleaved round by round (the order reversed every other round) so the host's drifting bandwidth
falls on both alike; medians, native ÷ eager.

    python benchmarks/native_decoder_ab.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m --tokens 1,4,16
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from specstack.engine.timing import forward_steps, random_context
from specstack.models import w4a8
from specstack.models.loading import load_model
from specstack.models.native_decoder import FORCE_ENV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--tokens", default="1,4,16", help="tokens T per forward")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"w4a8 path: {w4a8.kernel_for(torch.device('cpu')).name}, {args.threads} threads, context {args.context}")
    for name in args.models.split(","):
        lm = load_model(name, dtype="w4a8")
        model = lm.model
        step = forward_steps(lm, random_context(args.context, model.config.vocab_size), max(tokens))[
            "specstack w4a8 chain"]
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for mode in ("eager", "native") if r % 2 == 0 else ("native", "eager"):
                os.environ[FORCE_ENV] = mode
                model._drop_native()  # chosen again at the next forward, under the forced mode
                for t in tokens:
                    tok = torch.full((1, t), 5)
                    step(tok)  # untimed: the switch's first forward builds the decoder
                    for _ in range(3):
                        t0 = time.perf_counter()
                        step(tok)
                        times.setdefault((mode, t), []).append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        row = "  ".join(f"T={t}: {1e3 * med['eager', t]:.2f} -> {1e3 * med['native', t]:.2f} ms "
                        f"({med['native', t] / med['eager', t]:.3f})" for t in tokens)
        print(f"{name}: {row}")
    os.environ.pop(FORCE_ENV, None)


if __name__ == "__main__":
    main()
