"""A built model's cache file and its load, per weight format: the file's size, a load from it (seconds,
best of the repeats, each a whole `load_model` from the warm file), the bytes a one-token step reads and
the bytes the model holds resident (its dense copies for wide inputs included). Runs against whatever
specstack is importable, so two checkouts compare in one session:

    python benchmarks/format_cache_load.py --model smollm2-135m --formats int4,int8 --cache /tmp/c-new
    (cd /tmp/old && python ../main/benchmarks/format_cache_load.py ... --cache /tmp/c-old)
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--cache", required=True, help="an empty folder for the built models (SPECSTACK_CACHE)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ["SPECSTACK_CACHE"] = a.cache
    import torch

    from specstack.models.loading import load_model, model_cache_dir
    from specstack.models.quant import QLinear
    from specstack.models.registry import resolve

    torch.set_num_threads(a.threads)
    print("| format | build s | cache file MB | load s (best) | step reads MB | resident MB |\n|---|---:|---:|---:|---:|---:|")
    for fmt in a.formats.split(","):
        t0 = time.perf_counter()
        load_model(a.model, dtype=fmt, tokenizer=False)
        build = time.perf_counter() - t0
        cdir = model_cache_dir(resolve(a.model))
        files = [p for p in cdir.glob("*.safetensors") if p.name.startswith((f"{fmt}-", f"{fmt}."))]
        loads = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            model = load_model(a.model, dtype=fmt, tokenizer=False).model
            loads.append(time.perf_counter() - t0)
        step = sum(m.step_bytes() for m in model.modules() if isinstance(m, QLinear))
        resident = sum(t.nbytes for t in model.buffers()) + sum(p.nbytes for p in model.parameters())
        size = sum(p.stat().st_size for p in files)
        print(f"| {fmt} | {build:.1f} | {size / 1e6:.1f} | {min(loads):.2f} | {step / 1e6:.1f} | {resident / 1e6:.1f} |")


if __name__ == "__main__":
    main()
