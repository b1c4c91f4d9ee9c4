"""A model's T-token forwards with its weights on huge pages against the same model on 4 KiB pages, in one
process: the model is loaded twice (models/huge_pages.py moves the first; SPECSTACK_HUGE_PAGES=0 leaves the
second put) and the two copies' forwards alternate, so the host's drift, which between processes here
exceeds the difference, cancels. Median ms of the repeats, and the ratio.

    python benchmarks/huge_pages_ab.py --model qwen2.5-coder-1.5b --tokens 1,4,8 --repeats 21
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specstack.engine.timing import forward_steps, random_context
from specstack.models import huge_pages
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tokens = [int(v) for v in a.tokens.split(",")]
    print(f"weights: {huge_pages.describe()}", flush=True)
    steps = {}
    for label, setting in (("huge pages", "1"), ("4 KiB pages", "0")):
        os.environ[huge_pages.FORCE_ENV] = setting
        lm = load_model(a.model, dtype="w4a8", tokenizer=False)
        ctx = random_context(a.context, lm.model.config.vocab_size)
        steps[label] = forward_steps(lm, ctx, max(tokens))[f"specstack {lm.fmt} chain"]  # at the context, rolled back
    os.environ.pop(huge_pages.FORCE_ENV)
    huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages:")) >> 10
    print(f"AnonHugePages of this process: {huge} MB", flush=True)
    with torch.inference_mode():
        for t in tokens:
            x = torch.full((1, t), 5)
            times: dict[str, list[float]] = {label: [] for label in steps}
            for rep in range(a.repeats + 2):
                for label in list(steps)[:: 1 if rep % 2 else -1]:  # each copy first every other repeat
                    t0 = time.perf_counter()
                    steps[label](x)
                    if rep >= 2:  # two warm-up rounds
                        times[label].append((time.perf_counter() - t0) * 1e3)
            on, off = (statistics.median(v) for v in times.values())
            print(f"T = {t}: huge pages {on:.1f} ms, 4 KiB pages {off:.1f} ms, ratio {on / off:.3f}", flush=True)


if __name__ == "__main__":
    main()
