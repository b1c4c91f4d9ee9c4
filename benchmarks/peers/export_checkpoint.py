"""A Hugging Face checkpoint (config, tokenizer, bf16 safetensors) of a registry model's GGUF, offline,
for the peers that cannot read a GGUF well: vLLM's CPU build (no GGUF without a plugin) and OpenVINO's own
int4 IR (exported from these weights by optimum-intel, benchmarks/peers/export_openvino.sh).

transformers dequantizes the GGUF (its Q4_K/Q6_K blocks to fp32) and writes the weights in bf16: the
numbers a peer reads are the GGUF's, rounded once more to bf16, nothing fetched from a hub.

    python benchmarks/peers/export_checkpoint.py qwen2.5-coder-1.5b [OUT]
    (default OUT: $SPECSTACK_CACHE/hf/<model>, ~/.cache/specstack/hf/<model>)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specstack.files import cache_root
from specstack.models.registry import resolve

DEFAULT_ROOT = cache_root() / "hf"


def export(model: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve(model)
    if src.kind != "gguf":
        raise SystemExit(f"export_checkpoint: {model} is not a GGUF model ({src.kind})")
    folder, name = str(src.path.parent), src.path.name
    print(f"reading {src.path}", file=sys.stderr)
    lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # the weights are plain bf16 tensors now; transformers still marks the model as GGUF-quantized
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"wrote {out}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a registry model with a GGUF, e.g. qwen2.5-coder-1.5b")
    ap.add_argument("out", nargs="?", type=Path, help="the checkpoint's folder (default the cache's hf/MODEL)")
    a = ap.parse_args()
    export(a.model, a.out or DEFAULT_ROOT / a.model)


if __name__ == "__main__":
    main()
