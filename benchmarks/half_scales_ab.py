"""A draft model's forward with its q5a8 and q8a8 group scales in fp16 (the wide layout's default where they
are exact in it: models/w4a8_wide.py `HALF_SCALES`) against the same model with them in fp32, paired in one
process: the model is loaded twice (once with `HALF_SCALES` emptied), both are checked to give the same
logits bit for bit over a prompt, and their forwards of T tokens alternate at the same context
(bench-forward's `time_interleaved`). Prints the bytes each copy streams and, per T, each copy's median and
the median of the paired forwards' ratios (fp16 / fp32). Needs a CPU on a wide path (AVX-512-VNNI).

    python benchmarks/half_scales_ab.py --model qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b --t 1,4
"""
from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from specstack.bench.forward import time_interleaved
from specstack.engine.draft_sources import restricted_head
from specstack.engine.timing import forward_steps, random_context
from specstack.models import w4a8_wide
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.models.registry import default_draft_vocab


def load(name: str, target: LoadedModel | None, vocab: int | None, half: bool) -> LoadedModel:
    kept = w4a8_wide.HALF_SCALES
    w4a8_wide.HALF_SCALES = kept if half else frozenset()
    try:
        lm = load_model(name, dtype="w4a8")
    finally:
        w4a8_wide.HALF_SCALES = kept
    return lm if target is None or not vocab else restricted_head(lm, target, vocab)  # the draft as drafting cuts it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="whose token ranking cuts the head ('': the full head)")
    ap.add_argument("--t", default="1,4", help="tokens a forward, comma-separated")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=240, help="forwards of each copy, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_model(a.target, dtype="w4a8") if a.target else None
    vocab = default_draft_vocab(a.target) if a.target else None
    models = {"fp32": load(a.model, target, vocab, half=False), "fp16": load(a.model, target, vocab, half=True)}
    ctx = random_context(a.context, models["fp16"].model.config.vocab_size)
    logits = {}
    for key, lm in models.items():
        streamed = sum(b.numel() * b.element_size() for b in lm.model.buffers())
        half = sum(b.numel() * b.element_size() for b in lm.model.buffers() if b.dtype == torch.float16)
        print(f"{key}: {lm.name}, buffers {streamed / 1e6:.1f} MB ({half / 1e6:.1f} MB of fp16 scales)")
        logits[key] = lm.model.extend(torch.tensor([ctx]), lm.model.new_cache(1, a.context + 8)).logits
    print("the same logits bit for bit:", torch.equal(logits["fp32"], logits["fp16"]))
    for t in (int(v) for v in a.t.split(",")):
        steps = {k: forward_steps(lm, ctx, t)[f"specstack {lm.fmt} chain"] for k, lm in models.items()}
        tok = torch.full((1, t), 5)
        calls = {k: (lambda step=step, tok=tok: step(tok)) for k, step in steps.items()}
        times = time_interleaved(calls, a.repeats, warmup=10, bar=tqdm(total=a.repeats, disable=True))
        ratios = [h / f for h, f in zip(times["fp16"], times["fp32"], strict=True)]
        q = statistics.quantiles(ratios, n=4)
        print(f"T={t}: fp32 {statistics.median(times['fp32']):.2f} ms, fp16 {statistics.median(times['fp16']):.2f} ms; "
              f"fp16 / fp32 per pair: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}, {q[2]:.3f})", flush=True)

if __name__ == "__main__":
    main()
