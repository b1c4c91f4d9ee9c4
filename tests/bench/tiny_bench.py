"""The tiny checkpoint the `specstack bench` tests run on (tests/bench/test_bench.py, test_bench_batch.py):
a random 2-layer Llama with the default model's tokenizer, spread logits (initializer_range 0.15: varied
output, no near-ties), and a prompt file beside it."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specstack.models.registry import DEFAULT_MODEL


def save_tiny_bench_model(path: Path, prompts: Sequence[dict]) -> Path:
    """Write the checkpoint to `path` and the prompts (JSONL) to path.parent / prompts.jsonl."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.15, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    (path.parent / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path
