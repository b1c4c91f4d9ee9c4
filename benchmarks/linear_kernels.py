"""Issue 30, item 1: the low-bit matmuls side by side on one model's linears, in one run. For each row
count T, the time of every linear of every block (fused q|k|v, o, gate|up, down; not cache-resident
together) in each kernel: torch's int4 (`_weight_int4pack_mm_for_cpu`, bf16 activations), w8a8
(fbgemm, activations rounded per row) and w4a8 (ours, models/kernels/w4a8.cpp, activations rounded
per row and group), w4a8 once per path of its kernel table this CPU runs (`w4a8:avx2`, `w4a8:vnni512`),
and the unembedding in w4a8's 8-bit groups (`q8a8`, per path) and in Q6_K's 6-bit ones (`k6a8`). Random weights of the model's shapes:
the kernels' cost does not depend on the values. Kernels interleaved per repeat, best of the repeats; the bytes each reads beside the
machine's copy bandwidth (bench/bandwidth.py).

    python benchmarks/linear_kernels.py [--model qwen2.5-coder-1.5b] [--tokens 1,2,4,8,16,32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from specstack.bench.bandwidth import measure_bandwidth
from specstack.models import w4a8
from specstack.models.configs import read_gguf_config
from specstack.models.quant import QLinear
from specstack.models.registry import resolve

CPU = torch.device("cpu")
PATHS = [k.name for k in w4a8.KERNELS if k.name != "reference" and k.applies(CPU)]
# a format, or a w4a8 format on one path of its kernel table (format:path)
FORMATS = ("int4", "w8a8", *(f"{f}:{p}" for f in ("w4a8", "q8a8", "k6a8") for p in PATHS))
HEAD_ONLY = ("q8a8", "k6a8")  # formats timed on the unembedding alone


def shapes(model: str) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(in, out) of every linear of one block, as the engine fuses them; the head's."""
    cfg = read_gguf_config(resolve(model).path)
    up = (2 if cfg.block.gated else 1) * cfg.d_ff
    return [(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim), (cfg.q_dim, cfg.d_model), (cfg.d_model, up),
            (cfg.d_ff, cfg.d_model)], cfg.n_layers, (cfg.d_model, cfg.vocab_size)


def build(fmt: str, block: list[tuple[int, int]], n_layers: int, head: tuple[int, int]) -> list[QLinear]:
    """The layers of `fmt` (HEAD_ONLY: the head alone), bound to the named path."""
    name, _, path = fmt.partition(":")
    if path:
        os.environ[w4a8.FORCE_ENV] = path
    try:
        shape_list = [head] if name in HEAD_ONLY else block * n_layers
        built = []
        for k, n in shape_list:
            lin = QLinear(k, n, name).set_float(torch.randn(n, k) * 0.02)
            lin.wide_rows = None  # the small-format kernel at every T (what this measures)
            lin(torch.zeros(1, k, dtype=lin.act_dtype))  # bound now, under the forced path
            built.append(lin)
        return built
    finally:
        os.environ.pop(w4a8.FORCE_ENV, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    block, n_layers, head = shapes(a.model)
    layers: dict[str, list] = {}
    for fmt in FORMATS:
        print(f"building {fmt} layers...", flush=True)
        layers[fmt] = build(fmt, block, n_layers, head)
    bw = measure_bandwidth()
    nbytes = {f: sum(lin.step_bytes() for lin in layers[f]) for f in FORMATS}
    rows = []
    with torch.inference_mode():
        for t in (int(v) for v in a.tokens.split(",")):
            xs = {k: torch.randn(t, k) for k, _ in [*block, head]}
            best = dict.fromkeys(FORMATS, float("inf"))
            for rep in range(a.repeats + 1):
                for fmt in FORMATS[rep % len(FORMATS):] + FORMATS[: rep % len(FORMATS)]:
                    act = layers[fmt][0].act_dtype
                    x = {k: v.to(act) for k, v in xs.items()}
                    t0 = time.perf_counter()
                    for lin in layers[fmt]:
                        lin(x[lin.in_features])
                    if rep:  # the first round warms up (fbgemm packs its layers at first use)
                        best[fmt] = min(best[fmt], time.perf_counter() - t0)
            for fmt in FORMATS:
                rows.append({"format": fmt, "tokens": t, "ms": best[fmt] * 1e3, "bytes": nbytes[fmt]})
            print(f"T = {t}: " + ", ".join(f"{f} {best[f] * 1e3:.1f} ms" for f in FORMATS), flush=True)
    print(f"bandwidth {bw / 1e9:.1f} GB/s; floors: " + ", ".join(
        f"{f} {nbytes[f] / 1e6:.0f} MB -> {nbytes[f] / bw * 1e3:.1f} ms" for f in FORMATS))
    print("\n| format | " + " | ".join(f"T = {r['tokens']}" for r in rows if r["format"] == FORMATS[0]) + " |")
    print("|---|" + "---:|" * sum(r["format"] == FORMATS[0] for r in rows))
    for fmt in FORMATS:
        mine = [r for r in rows if r["format"] == fmt]
        print(f"| {fmt} | " + " | ".join(f"{r['ms']:.1f} ({r['ms'] / mine[0]['ms']:.2f})" for r in mine) + " |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"model": a.model, "bandwidth": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
