"""The wide layout's matmuls on the AMX tiles against the AVX-512-VNNI tiles, one layer shape at a time,
in one process and alternating (the host's drifting speed falls on both alike): for each row count T the
median time of each, their ratio, and whether the outputs are bit for bit the same (they must be). It
picks the row count from which the `_amx` ops take the AMX tiles (models/kernels/w4a8_wide.cpp
`amx_from`). Needs a CPU with AMX-INT8.

    python benchmarks/amx_tiles_ab.py --shapes 1536x8960,8960x1536 --formats k4a8,k6a8 --t 1,2,4,8,16,32
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specstack.models import native, w4a8_wide
from specstack.models.quant import QLinear

# the Qwen2.5-Coder-1.5B's linears (in x out): q/o, k/v, gate/up, down
SHAPES = "1536x1536,1536x256,1536x8960,8960x1536"


def timed(run, x: torch.Tensor, repeats: int) -> float:
    run(x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run(x)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    ap.add_argument("--formats", default="k4a8,k6a8,q8a8")
    ap.add_argument("--t", default="1,2,3,4,6,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not (native.has_amx() and native.load("w4a8_wide")):
        raise SystemExit("amx_tiles_ab: this CPU (or its kernel) gives this process no AMX")
    ops = torch.ops.specstack_w4a8_wide
    before = ops.set_amx_from(1)  # the _amx ops on the tiles at every row count
    try:
        print(f"{'layer':>22} {'T':>3} {'vnni ms':>8} {'amx ms':>8} {'amx/vnni':>8} same")
        for fmt in a.formats.split(","):
            for shape in a.shapes.split(","):
                k, n = (int(v) for v in shape.split("x"))
                lin = QLinear(k, n, fmt)
                lin.method.fill_float(lin, torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05)
                wide = w4a8_wide.to_wide(fmt, *lin.method.stored(lin))
                vnni, amx = w4a8_wide.kernel(fmt, *wide), w4a8_wide.kernel(fmt, *wide, "_amx")
                for t in (int(v) for v in a.t.split(",")):
                    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
                    same = torch.equal(vnni(x), amx(x))
                    times: dict[str, list[float]] = {"vnni": [], "amx": []}
                    for r in range(a.rounds):
                        for name in (("vnni", "amx") if r % 2 == 0 else ("amx", "vnni")):
                            times[name].append(timed(vnni if name == "vnni" else amx, x, a.repeats))
                    v, m = statistics.median(times["vnni"]) * 1e3, statistics.median(times["amx"]) * 1e3
                    print(f"{fmt + ' ' + shape:>22} {t:>3} {v:8.3f} {m:8.3f} {m / v:8.3f} {'yes' if same else 'NO'}",
                          flush=True)
    finally:
        ops.set_amx_from(before)


if __name__ == "__main__":
    main()
