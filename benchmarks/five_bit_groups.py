"""GGUF Q5_0's layers two ways, in one process: as `q5a8` (their own 5-bit codes, 6 bits a weight with the
fp32 scale) and as `q8a8` (8-bit groups, 9 bits), on every w4a8 kernel path this CPU runs. The layers are
those of the 0.5B's blocks its file keeps in Q5_0 and our plan keeps whole (o, gate|up; 24 blocks of
each), random weights of their shapes (the kernels' cost does not depend on the values); paths and
formats interleaved per repeat, best of the repeats, ms for all of them.

    python benchmarks/five_bit_groups.py [--model qwen2.5-coder-0.5b] [--tokens 1,4,16] [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from specstack.bench.bandwidth import measure_read_bandwidth
from specstack.models import w4a8
from specstack.models.configs import read_gguf_config
from specstack.models.quant import QLinear
from specstack.models.registry import resolve

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = read_gguf_config(resolve(a.model).path)
    shapes = [(cfg.q_dim, cfg.d_model), (cfg.d_model, 2 * cfg.d_ff)] * cfg.n_layers
    paths = [k.name for k in w4a8.KERNELS if k.name != "reference" and k.applies(CPU)]
    variants: dict[str, list[QLinear]] = {}
    for path in paths:
        os.environ[w4a8.FORCE_ENV] = path
        for fmt in ("q5a8", "q8a8"):
            layers = []
            for k, n in shapes:
                lin = QLinear(k, n, fmt).set_float(torch.randn(n, k) * 0.02)
                lin(torch.zeros(1, k))  # bound now, under the forced path
                layers.append(lin)
            variants[f"{fmt}:{path}"] = layers
    os.environ.pop(w4a8.FORCE_ENV, None)
    tokens = [int(t) for t in a.tokens.split(",")]
    best = {(v, t): float("inf") for v in variants for t in tokens}
    for _ in range(a.repeats):
        for t in tokens:
            xs = {k: torch.randn(t, k) for k in {k for k, _ in shapes}}
            for name, layers in variants.items():
                t0 = time.perf_counter()
                for lin in layers:
                    lin(xs[lin.in_features])
                best[name, t] = min(best[name, t], time.perf_counter() - t0)
    read = measure_read_bandwidth()
    print(f"{a.model}: {len(shapes)} layers (o, gate|up of {cfg.n_layers} blocks); read bandwidth {read / 1e9:.1f} GB/s\n")
    print("| layers | MB read | " + " | ".join(f"T = {t} (ms)" for t in tokens) + " |")
    print("|---|---:|" + "---:|" * len(tokens))
    for name, layers in variants.items():
        mb = sum(lin.step_bytes() for lin in layers) / 1e6
        cells = []
        for t in tokens:
            ms = 1e3 * best[name, t]
            other = name.replace("q5a8", "q8a8") if name.startswith("q5a8") else None
            ratio = f" ({best[name, t] / best[other, t]:.2f})" if other else ""
            cells.append(f"{ms:.2f}{ratio}")
        print(f"| {name} | {mb:.0f} | " + " | ".join(cells) + " |")
    print("\n(q5a8's times in brackets: over q8a8's on the same path)")


if __name__ == "__main__":
    main()
