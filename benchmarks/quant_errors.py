"""What each GGUF quant type becomes, and the error of that choice (issue 29, docs/bench-history "Quant
types"): for every linear layer of a GGUF model, the relative error ||W_kernel - W_gguf|| / ||W_gguf||
of the weight the chosen format computes with (its dense copy, as the kernel dequantises) against the
file's own dequantised fp32 weight, grouped by (source types -> format). Beside int4's choice for the
wider types (int8), the error requantising them into int4 would have cost, and the first load's time
of each format (a fresh cache folder).

    python benchmarks/quant_errors.py --model qwen2.5-coder-1.5b [--formats int4,int8] [--out bench_out/quant]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specstack.models.loading import layer_parts, load_model, read_gguf
from specstack.models.quant import QLinear
from specstack.models.registry import resolve


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp(min=1e-12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--out", type=Path, default=Path("bench_out/quant"))
    args = ap.parse_args()
    src = resolve(args.model)
    _, ref, _ = read_gguf(src.path, "fp32")
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(src.path)).tensors}
    doc: dict[str, object] = {"model": args.model, "file": src.path.name, "formats": {}}
    for fmt in args.formats.split(","):
        with tempfile.TemporaryDirectory() as cache:  # the first load: conversion from the GGUF
            os.environ["SPECSTACK_CACHE"] = cache
            t0 = time.perf_counter()
            lm = load_model(args.model, dtype=fmt, tokenizer=False)
            first_load = time.perf_counter() - t0
            t0 = time.perf_counter()
            load_model(args.model, dtype=fmt, tokenizer=False)
            cached_load = time.perf_counter() - t0
        groups: dict[str, list[float]] = defaultdict(list)
        requant: dict[str, list[float]] = defaultdict(list)
        model = lm.model
        for layer, parts in layer_parts(lm.config).items():
            mod = model.head if layer == "head" else getattr(model.layers[int(layer.split(".")[1])], layer.split(".")[2])
            w = torch.cat([ref[p] for p in parts])
            src_types = "+".join(sorted({_gguf_type(types, p) for p in parts}))
            key = f"{src_types} -> {mod.fmt}"
            dense = mod.dense if mod.dense is not None else mod.weight
            groups[key].append(rel(dense, w))
            if fmt == "int4" and mod.fmt == "int8":  # what int4 would have cost this layer
                q = QLinear(w.shape[1], w.shape[0], "int4").set_float(w)
                requant[f"{src_types} -> int4 (requantised)"].append(rel(q.dense, w))
        doc["formats"][fmt] = {  # type: ignore[index]
            "first_load_s": round(first_load, 1), "cached_load_s": round(cached_load, 1),
            "layers": {k: {"n": len(v), "mean_rel_error": sum(v) / len(v), "max_rel_error": max(v)}
                       for k, v in {**groups, **requant}.items()}}
        del lm, model
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.model}.json").write_text(json.dumps(doc, indent=1))
    print(f"# {args.model} ({src.path.name})")
    for fmt, f in doc["formats"].items():  # type: ignore[union-attr]
        print(f"\n{fmt}: first load {f['first_load_s']} s, cached {f['cached_load_s']} s")
        print("| layers (GGUF types -> format) | n | mean rel. error | max |\n|---|---:|---:|---:|")
        for k, v in f["layers"].items():
            print(f"| {k} | {v['n']} | {v['mean_rel_error']:.2e} | {v['max_rel_error']:.2e} |")


GGUF_OF = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
           "down": "ffn_down"}


def _gguf_type(types: dict[str, str], canonical: str) -> str:
    if canonical == "head":
        return types["output.weight"]
    if canonical == "embed":
        return types["token_embd.weight"]
    _, i, name = canonical.split(".")
    return types[f"blk.{i}.{GGUF_OF[name]}.weight"]


if __name__ == "__main__":
    main()
