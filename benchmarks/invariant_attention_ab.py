"""The batch-invariant formats' attention, both kernels of models/fixed_attention.py in one process: one
model loaded twice (SPECSTACK_INVARIANT_ATTENTION=fixed, then float64), each with its own cache at the
same context, forwards of T tokens interleaved so machine drift cancels. Median ms of the repeats.

    python benchmarks/invariant_attention_ab.py --model qwen2.5-coder-1.5b --contexts 256,1024 --tokens 1,4,16
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specstack.attention import build_batch
from specstack.models import fixed_attention
from specstack.models.loading import load_model

KERNELS = ("fixed", "float64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="w4a8")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {}
    for name in KERNELS:
        os.environ[fixed_attention.FORCE_ENV] = name
        model = load_model(a.model, dtype=a.dtype, tokenizer=False).model
        assert model.invariant_attention() is not None and model.invariant_attention().name == name
        models[name] = model
    os.environ.pop(fixed_attention.FORCE_ENV, None)
    print(f"| context | T | {' | '.join(KERNELS)} | fixed / float64 |\n|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for ctx in (int(c) for c in a.contexts.split(",")):
            prompt = torch.randint(0, 1000, (1, ctx), generator=torch.Generator().manual_seed(ctx))
            caches = {}
            prefill = {}
            for name, model in models.items():
                caches[name] = model.new_cache(1)
                t0 = time.perf_counter()
                model.extend(prompt, caches[name])
                prefill[name] = (time.perf_counter() - t0) * 1e3
            print(f"| {ctx} | prefill | {' | '.join(f'{prefill[n]:.0f}' for n in KERNELS)} | "
                  f"{prefill['fixed'] / prefill['float64']:.2f} |", flush=True)
            for t in (int(v) for v in a.tokens.split(",")):
                tokens = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
                times: dict[str, list[float]] = {n: [] for n in KERNELS}
                for rep in range(a.repeats + 2):
                    for name in KERNELS[rep % 2:] + KERNELS[: rep % 2]:
                        model, cache = models[name], caches[name]
                        t0 = time.perf_counter()
                        model.forward(tokens, build_batch(cache, t), cache)
                        if rep >= 2:
                            times[name].append((time.perf_counter() - t0) * 1e3)
                med = {n: statistics.median(v) for n, v in times.items()}
                print(f"| {ctx} | {t} | {' | '.join(f'{med[n]:.1f}' for n in KERNELS)} | "
                      f"{med['fixed'] / med['float64']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
