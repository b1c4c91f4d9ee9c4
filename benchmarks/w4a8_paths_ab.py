"""One model's whole one-token forward (and T-token forwards) on each w4a8 kernel path this CPU runs,
in one process, interleaved: the model is loaded once per path and each copy's layers are bound under
that path (SPECSTACK_W4A8_KERNEL at its first forward), so machine drift, which between separate runs
here reaches 1.5 x in memory bandwidth, cancels. Median of the repeats, ms. A path that plans GGUF Q6_K
or Q5_0 layers in their own groups (k6a8, q5a8: w4a8.NARROW_PATHS) also runs with them as q8a8
(`path/q8a8`): the two plans, one process.

    python benchmarks/w4a8_paths_ab.py --model qwen2.5-coder-1.5b --tokens 1,4,16 --repeats 15
    python benchmarks/w4a8_paths_ab.py --paths amx,wide512 --tokens 1,8,16,32,64
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specstack.attention import build_batch
from specstack.models import w4a8
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="", help="only these paths (comma-separated; default: every one this CPU runs)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    names = [k.name for k in w4a8.KERNELS if k.name != "reference" and k.applies(cpu)
             and (not a.paths or k.name in a.paths.split(","))]
    narrow = dict(w4a8.NARROW_PATHS)
    # (label, path, whether the narrow layer formats its path runs fast are planned)
    variants = [(n, n, True) for n in names]
    if not a.paths:
        variants += [(f"{n}/q8a8", n, False) for n in names if any(n in paths for paths in narrow.values())]
    paths = [label for label, _, _ in variants]
    runs = {}
    with torch.inference_mode():
        for label, path, planned in variants:
            os.environ[w4a8.FORCE_ENV] = path
            w4a8.NARROW_PATHS = narrow if planned else {f: frozenset() for f in narrow}
            model = load_model(a.model, dtype="w4a8", tokenizer=False).model
            cache = model.new_cache(1)
            model.extend(torch.randint(0, 1000, (1, a.context), generator=torch.Generator().manual_seed(0)), cache)
            runs[label] = (model, cache)  # bound under `path` by that first forward
        os.environ.pop(w4a8.FORCE_ENV, None)
        w4a8.NARROW_PATHS = narrow
        for t in (int(v) for v in a.tokens.split(",")):
            tokens = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
            times: dict[str, list[float]] = {p: [] for p in paths}
            for rep in range(a.repeats + 2):
                for path in paths[rep % len(paths):] + paths[: rep % len(paths)]:
                    model, cache = runs[path]
                    t0 = time.perf_counter()
                    model.forward(tokens, build_batch(cache, t), cache)
                    if rep >= 2:
                        times[path].append((time.perf_counter() - t0) * 1e3)
            print(f"T = {t}: " + ", ".join(f"{p} {statistics.median(v):.1f} ms" for p, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
