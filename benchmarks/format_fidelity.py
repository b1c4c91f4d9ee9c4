"""How far each weight format's model is from the GGUF's own numbers (issue 30, docs/bench-history
"The batch-invariant format"): teacher-forced next-token distributions over a held-out text (this
repository's own source and an English paragraph, never a benchmark's prompts) against the fp32
model of the same file, per format: the mean KL(fp32 || format) and how often the argmax agrees.

    python benchmarks/format_fidelity.py --model qwen2.5-coder-1.5b --formats int4,w8a8 [--tokens 600] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specstack.models.loading import load_model

TEXT = (Path(__file__).resolve().parents[1] / "specstack" / "engine" / "batched.py").read_text()[:6000] + (
    "\nUser: Tell me about the history of Rome, from the republic to the fall of the western empire, "
    "and what its emperors did for the city's roads, water and laws.\n")


def logits(name: str, fmt: str, ids: list[int]) -> torch.Tensor:
    lm = load_model(name, dtype=fmt, tokenizer=False)
    cache = lm.model.new_cache(1, len(ids) + 8)
    with torch.no_grad():
        return lm.model.extend(torch.tensor([ids]), cache).logits[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="int4,int8,bf16,w8a8")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_model(a.model, dtype="fp32").tokenizer
    ids = tok(TEXT)["input_ids"][: a.tokens]
    ref = logits(a.model, "fp32", ids)
    p = torch.log_softmax(ref, -1)
    rows = []
    for fmt in a.formats.split(","):
        q = torch.log_softmax(logits(a.model, fmt, ids), -1)
        kl = float((p.exp() * (p - q)).sum(-1).mean())
        top1 = float((p.argmax(-1) == q.argmax(-1)).float().mean())
        rows.append({"model": a.model, "format": fmt, "tokens": len(ids), "kl_vs_fp32": kl, "top1_agreement": top1})
        print(f"{a.model} {fmt}: KL {kl:.4f}, argmax agrees on {100 * top1:.1f} % of {len(ids)} tokens", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
