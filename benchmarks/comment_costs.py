"""The small costs the code's comments reason about, measured again (docs/bench-history, "Small costs
behind the code's choices"): each is a micro-benchmark of one operation the code avoids or batches,
timed alone on this machine, the fastest of its repeats (a micro-benchmark's cost without the
interference of whatever else shares the two cores). The comments keep the reason in words; the numbers
live in docs/bench-history, where they carry a date and a machine.

    python benchmarks/comment_costs.py [--threads 2] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specstack.drafting.katz import KatzTrigram
from specstack.machine import cpu_model
from specstack.models.dense_copy_methods import _INT4_MM_CPU, INT4_GROUP
from specstack.models.quant import QLinear
from specstack.models.registry import default_ngram_path
from specstack.models.row_ops import rms_norm

# SmolLM2-135M, the default model: d 576, 9 query / 3 KV heads of 64, MLP 1536, 30 layers, vocab 49152
D, KV, FF, LAYERS, VOCAB = 576, 192, 1536, 30, 49152


def per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds per call of fn: the fastest of `repeats` runs of `calls` calls."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times)


def module_overheads(repeats: int) -> dict[str, float]:
    """nn.Module's attribute lookup (`__getattr__`, for parameters and buffers) and `__call__`'s hook
    checks, in µs, against a plain attribute and a direct `.forward`."""
    lin = nn.Linear(8, 8)
    plain = type("Plain", (), {})()
    plain.weight = lin.weight
    x = torch.zeros(1, 8)
    lookup = per_call(lambda: lin.weight, 100_000, repeats) - per_call(lambda: plain.weight, 100_000, repeats)
    call = per_call(lambda: lin(x), 20_000, repeats) - per_call(lambda: lin.forward(x), 20_000, repeats)
    return {"Module.__getattr__ lookup (µs)": 1e6 * lookup, "Module.__call__ over .forward (µs)": 1e6 * call}


def norms(repeats: int) -> dict[str, float]:
    """F.rms_norm against the fused-LayerNorm form of models/transformer.py, one row of d = 576, µs."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(1, D, dtype=dtype), torch.ones(D, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        out[f"F.rms_norm, {name} (µs)"] = 1e6 * per_call(lambda x=x, w=w: F.rms_norm(x, (D,), w, 1e-5), 5000, repeats)
        out[f"rms_norm (fused), {name} (µs)"] = 1e6 * per_call(lambda x=x, w=w: rms_norm(x, w, 1e-5), 5000, repeats)
    return out


def int8_head(repeats: int) -> dict[str, float]:
    """The int8 unembedding (49152 x 576) for one row, with bf16 and with fp32 activations, ms."""
    w = torch.randn(VOCAB, D) * 0.02
    out = {}
    for act in (torch.bfloat16, torch.float32):
        head = QLinear(D, VOCAB, "int8", activation=act).set_float(w)
        x = torch.randn(1, D, dtype=act)
        out[f"int8 head, {str(act).removeprefix('torch.')} activations (ms)"] = 1e3 * per_call(
            lambda head=head, x=x: head(x), 50, repeats)
    return out


def topk_rows(repeats: int, rows: int = 80, width: int = 4) -> dict[str, float]:
    """Children of a staged step's rows over a 49152-column vocabulary: one top-k per row, or one call."""
    probs = torch.rand(rows, VOCAB)
    per_row = per_call(lambda: [torch.topk(probs[i], width) for i in range(rows)], 5, repeats)
    whole = per_call(lambda: torch.topk(probs, width, dim=-1), 20, repeats)
    return {f"top-{width}, one call per row (ms per row, {rows} rows)": 1e3 * per_row / rows,
            f"top-{width}, one call for {rows} rows (ms)": 1e3 * whole}


def int4_dense_through_kernel(repeats: int) -> dict[str, float]:
    """Re-deriving every int4 layer's dense copy through the kernel (an identity matrix in), for the
    default model's 30 blocks: what a load would pay if the copy were not stored, s."""
    shapes = [(D, D + 2 * KV), (D, D), (D, 2 * FF), (FF, D)]  # qkv, o, gate+up, down: (in, out)
    layers = [QLinear(k, n, "int4").set_float(torch.randn(n, k) * 0.02) for k, n in shapes]
    eyes = {k: torch.eye(k, dtype=torch.bfloat16) for k, _ in shapes}

    def block() -> None:
        for q in layers:
            _INT4_MM_CPU(eyes[q.in_features], q.weight, INT4_GROUP, q.scales_zeros)

    return {"int4 dense copies through the kernel, 30 blocks (s)": LAYERS * per_call(block, 1, repeats)}


def katz_warmup(repeats: int) -> dict[str, float]:
    """Materialising the shipped trigram's very common contexts when it loads, ms (a load with and
    without that step)."""
    path = default_ngram_path("smollm2-135m")
    warm = KatzTrigram._WARM_ENTRIES

    def load(entries: int) -> float:
        KatzTrigram._WARM_ENTRIES = entries
        try:
            return per_call(lambda: KatzTrigram.load(path), 1, repeats)
        finally:
            KatzTrigram._WARM_ENTRIES = warm

    return {"trigram's warm contexts at load (ms)": 1e3 * (load(warm) - load(1 << 62))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, {args.threads} threads, torch {torch.__version__}, fastest of {args.repeats}")
    print("| cost | value |\n|---|---:|")
    for part in (module_overheads, norms, int8_head, topk_rows, int4_dense_through_kernel, katz_warmup):
        for name, value in part(args.repeats).items():
            print(f"| {name} | {value:.3g} |", flush=True)


if __name__ == "__main__":
    main()
