"""Corrupt Hugging Face checkpoints (issue 18, kind 4; unit/corrupt.py holds the mutations and the checks):
damaged or mistyped weights, config.json files that are not JSON, not UTF-8, or describe an impossible
model, and a damaged cache of built models, which is rebuilt from the source."""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from unit.corrupt import (
    SEED,
    blind_damage,
    error_or_load,
    expect_error,
    header_flips,
    hf_copy,
    load_fp32,
    safetensors_header,
    with_byte_tokenizer,
)

import specstack.models.loading as loading
from specstack.models.loading import load_model


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama, tmp_path_factory) -> Path:
    return with_byte_tokenizer(tiny_llama, tmp_path_factory.mktemp("with-tokenizer"))


def test_damaged_model_safetensors(tiny_llama, tmp_path):
    data = (tiny_llama.path / "model.safetensors").read_bytes()
    header = safetensors_header(data)
    for label, damaged in blind_damage(data, header):
        d = hf_copy(tiny_llama.path, tmp_path / label)
        (d / "model.safetensors").write_bytes(damaged)
        msg = expect_error(lambda d=d: load_fp32(d), "model.safetensors", str(d))
        assert "not a readable safetensors file" in msg
    for label, damaged in header_flips(data, header):
        d = hf_copy(tiny_llama.path, tmp_path / label)
        (d / "model.safetensors").write_bytes(damaged)
        error_or_load(lambda d=d: load_fp32(d), str(d))


def test_damaged_pytorch_bin(tiny_llama, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(tiny_llama.path / "config.json", d / "config.json")
    torch.save(load_file(str(tiny_llama.path / "model.safetensors")), d / "pytorch_model.bin")
    data = (d / "pytorch_model.bin").read_bytes()
    for _label, damaged in blind_damage(data, 64):
        (d / "pytorch_model.bin").write_bytes(damaged)
        expect_error(lambda: load_fp32(d), "pytorch_model.bin", str(d))


BAD_LLAMA_CONFIGS: list[tuple[str, Callable[[dict], object], str]] = [
    ("not-json", lambda c: "{not json", "not JSON"),
    ("a-list", lambda c: [c], "not a JSON object"),
    ("zero-heads", lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads must be >= 1, got 0"),
    ("zero-kv-heads", lambda c: {**c, "num_key_value_heads": 0}, "num_key_value_heads must be >= 1, got 0"),
    ("negative-width", lambda c: {**c, "hidden_size": -64}, "hidden_size must be >= 1, got -64"),
    ("no-layers", lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, "num_hidden_layers is missing"),
    ("no-vocab", lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size is missing"),
    ("null-width", lambda c: {**c, "intermediate_size": None}, "intermediate_size is missing"),
    ("text-width", lambda c: {**c, "hidden_size": "wide"}, "hidden_size must be an integer"),
    ("bool-layers", lambda c: {**c, "num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ("kv-not-dividing", lambda c: {**c, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ("heads-not-dividing", lambda c: {**{k: v for k, v in c.items() if k != "head_dim"}, "num_attention_heads": 5,
                                      "num_key_value_heads": 5}, "hidden_size (64) must be a multiple of num_attention_heads (5)"),
    ("odd-head", lambda c: {**c, "head_dim": 15}, "must be even"),
    ("huge-context", lambda c: {**c, "max_position_embeddings": 10**12}, "max_position_embeddings must be <="),
    ("nan-eps", lambda c: {**c, "rms_norm_eps": "nan"}, "rms_norm_eps must be a finite number"),
    ("zero-theta", lambda c: {**c, "rope_theta": 0}, "rope_theta must be > 0"),
    ("rope-not-object", lambda c: {**c, "rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ("text-eos", lambda c: {**c, "eos_token_id": "end"}, "eos_token_id must be an integer"),
    ("bad-type", lambda c: {**c, "model_type": "bert"}, "unsupported model type 'bert'"),
    # sizes that disagree with the weights fail before a model of that size is allocated
    ("wider-than-weights", lambda c: {**c, "hidden_size": 1 << 20, "head_dim": 16}, "weight embed has shape"),
    ("more-layers", lambda c: {**c, "num_hidden_layers": 10**9}, "is missing"),
    ("longer-vocab", lambda c: {**c, "vocab_size": 10**8}, "weight embed has shape"),
]


@pytest.mark.parametrize("label, change, phrase", BAD_LLAMA_CONFIGS, ids=[c[0] for c in BAD_LLAMA_CONFIGS])
def test_bad_config_json(tiny_llama, tmp_path, label, change, phrase):
    d = hf_copy(tiny_llama.path, tmp_path / label)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)  # so rope_theta / rope_scaling at the top level are what is read
    new = change(cfg)
    (d / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    msg = expect_error(lambda: load_fp32(d), str(d), phrase)
    assert "config.json" in msg or "weights" in msg


def test_config_json_not_utf8(tiny_llama, tmp_path):
    d = hf_copy(tiny_llama.path, tmp_path / "latin1")
    (d / "config.json").write_bytes(b'{"model_type": "llama\xff"}')
    expect_error(lambda: load_fp32(d), f"config.json in {d}", "not UTF-8")


def test_gpt2_config_checks(tiny_gpt2, tmp_path):
    d = hf_copy(tiny_gpt2.path, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "n_head": 0}))
    expect_error(lambda: load_fp32(d), f"config.json in {d}", "n_head must be >= 1, got 0")


def _replace_tensor(d: Path, name: str, value: torch.Tensor | None) -> None:
    sd = load_file(str(d / "model.safetensors"))
    if value is None:
        del sd[name]
    else:
        sd[name] = value
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name, value, phrase", [
    ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32), "weight layers.0.q has shape [64, 32]"),
    ("model.norm.weight", torch.zeros(3, 3), "weight norm.weight has shape [3, 3]"),
    ("model.layers.1.mlp.down_proj.weight", None, "tensor layers.1.mlp.down_proj.weight is missing"),
], ids=["q-shape", "norm-shape", "missing"])
def test_weights_with_wrong_shapes(tiny_llama, tmp_path, name, value, phrase):
    d = hf_copy(tiny_llama.path, tmp_path / "w")
    _replace_tensor(d, name, value)
    expect_error(lambda: load_fp32(d), f"the weights in {d}", phrase)


def test_gpt2_conv1d_not_a_matrix(tiny_gpt2, tmp_path):
    d = hf_copy(tiny_gpt2.path, tmp_path / "gpt2")
    _replace_tensor(d, "transformer.h.0.attn.c_attn.weight", torch.zeros(2, 2, 2))
    expect_error(lambda: load_fp32(d), f"the weights in {d}", "h.0.attn.c_attn.weight has shape [2, 2, 2]")


# ---------------------------------------------------------------------------------------------------
# The cache of built models
# ---------------------------------------------------------------------------------------------------
def _logits(lm) -> torch.Tensor:
    from specstack.attention import build_batch

    ids = torch.tensor([[1, 5, 9, 200, 3]])
    cache = lm.model.new_cache(1)
    return lm.model.forward(ids, build_batch(cache, ids.shape[1]), cache).logits


def _from_cache_only(monkeypatch) -> None:
    def no_source(*_a, **_k):
        raise AssertionError("the model was rebuilt from its source, not read from the cache")

    monkeypatch.setattr(loading, "read_source", no_source)


@pytest.mark.parametrize("damage", ["cut-weights", "random-weights", "config-not-json", "config-other-shape",
                                    "config-missing", "config-zero-heads"])
def test_damaged_cache_is_rebuilt(tiny_llama, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    expected = _logits(load_model(str(tiny_llama.path), dtype="fp32", tokenizer=False))
    (cdir,) = (tmp_path / "cache").iterdir()
    built, cfg_file = cdir / "fp32-cpu.safetensors", cdir / "config.json"
    if damage == "cut-weights":
        built.write_bytes(built.read_bytes()[:1000])
    elif damage == "random-weights":
        built.write_bytes(random.Random(SEED).randbytes(4096))
    elif damage == "config-not-json":
        cfg_file.write_text("{")
    elif damage == "config-other-shape":
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "d_ff": 256}))
    elif damage == "config-missing":
        cfg_file.unlink()
    else:
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "n_heads": 0}))
    again = load_model(str(tiny_llama.path), dtype="fp32", tokenizer=False)  # rebuilt from the source
    assert torch.equal(_logits(again), expected)
    _from_cache_only(monkeypatch)  # and the rebuilt cache is whole again
    assert torch.equal(_logits(load_model(str(tiny_llama.path), dtype="fp32", tokenizer=False)), expected)


def test_damaged_cached_tokenizer_is_rebuilt(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    first = load_model(str(tiny_model_dir), dtype="fp32")
    (cdir,) = (tmp_path / "cache").iterdir()
    tok_json = cdir / "tokenizer" / "tokenizer.json"
    tok_json.write_bytes(tok_json.read_bytes()[:1000])
    again = load_model(str(tiny_model_dir), dtype="fp32")
    assert again.tokenizer("def f(x):").input_ids == first.tokenizer("def f(x):").input_ids
    assert json.loads(tok_json.read_text())  # replaced by a whole copy
    assert not list(cdir.glob("tokenizer-*")), "a temporary tokenizer folder was left behind"
