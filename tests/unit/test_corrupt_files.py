"""Corrupt model, draft and trigram files (issue 18, kind 4): every loader turns a malformed file into one
SpecstackError naming the file and what is wrong, never a traceback; the command line answers it with
exit 2 and one error line; a damaged cache is rebuilt from the source.

Each file starts valid (the tiny models of tests/conftest.py, a GGUF written as llama.cpp does, a draft
pruned from the tiny Llama, a small trigram) and is then cut, overwritten with random bytes, flipped in
its header, or given a malformed config. Mutations use a fixed seed and a bounded count.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from cli.test_cli_errors import CliResult, assert_error
from safetensors.torch import load_file, save_file
from unit.test_quant import _write_tiny_llama_gguf

import specstack.models.loading as loading
from specstack.cli.entry import main
from specstack.config import WindowSpec
from specstack.drafting.katz import KatzTrigram
from specstack.errors import SpecstackError
from specstack.models.draft_file import load_draft_file, save_draft
from specstack.models.loading import load_model
from specstack.training.prune import build_draft

SEED = 18
FLIPS = 12  # header mutations per file


# ---------------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------------
def blind_damage(data: bytes, header: int) -> list[tuple[str, bytes]]:
    """Files no reader may accept: empty, random bytes, cut inside the header, in the middle, one byte short."""
    rng = random.Random(SEED)
    return [("empty", b""), ("random", rng.randbytes(len(data))), ("random-short", rng.randbytes(64)),
            ("cut-4", data[:4]), ("cut-header", data[: header // 2]), ("cut-middle", data[: len(data) // 2]),
            ("cut-tail", data[:-64])]  # past any padding to an alignment (GGUF pads to 32 bytes)


def header_flips(data: bytes, header: int) -> list[tuple[str, bytes]]:
    """FLIPS copies with 1 to 3 random bytes of the header replaced: a reader may accept some (a flip in
    a name or a value), but must never fail other than with a SpecstackError."""
    rng = random.Random(SEED)
    out = []
    for i in range(FLIPS):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(header)] = rng.randrange(256)
        out.append((f"flip-{i}", bytes(b)))
    return out


def safetensors_header(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def expect_error(load: Callable[[], object], *names: str) -> str:
    """`load()` raises a SpecstackError whose one-line message names every one of `names`."""
    with pytest.raises(SpecstackError) as e:
        load()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def error_or_load(load: Callable[[], object], *names: str) -> None:
    """`load()` either succeeds or raises a SpecstackError naming `names`: nothing else escapes."""
    try:
        load()
    except SpecstackError as e:
        assert all(n in str(e) for n in names), str(e)


def load_fp32(path: Path, **kw) -> object:
    return load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False, **kw)


def hf_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with a tokenizer of its own (its 256 bytes, no merges, and an end token): enough
    for `specstack generate`, built in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab={**vocab, "</s>": len(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = hf_copy(tiny_llama.path, tmp_path_factory.mktemp("with-tokenizer") / "tiny")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(path))
    return path


# ---------------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------------
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
# GGUF
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_llama_gguf(tiny_llama.hf, path, tied=False)
    return path


def _gguf_kv_end(path: Path) -> int:
    """Where the GGUF's tensor data starts: mutations before it hit the metadata or tensor infos."""
    import gguf

    return gguf.GGUFReader(path).data_offset


def _set_u32(data: bytes, key: str, value: int) -> bytes:
    """The GGUF with the uint32 metadata value of `key` replaced (keys are length-prefixed strings)."""
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack("<I", data[at : at + 4])[0] == 4, "not a uint32 value"  # GGUFValueType.UINT32
    return data[: at + 4] + struct.pack("<I", value) + data[at + 8 :]


def test_damaged_gguf(tiny_gguf_file, tmp_path):
    data = tiny_gguf_file.read_bytes()
    header = _gguf_kv_end(tiny_gguf_file)
    for label, damaged in blind_damage(data, header):
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(damaged)
        expect_error(lambda p=path: load_fp32(p), str(path))
    for label, damaged in header_flips(data, header):
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(damaged)
        error_or_load(lambda p=path: load_fp32(p), str(path))


@pytest.mark.parametrize("change, phrase", [
    (lambda d: d.replace(b"general.architecture", b"general.architecturX"), "has no general.architecture"),
    (lambda d: d.replace(b"llama.embedding_length", b"llama.embedding_lengtX"), "llama.embedding_length is missing"),
    (lambda d: _set_u32(d, "llama.attention.head_count", 0), "llama.attention.head_count must be >= 1, got 0"),
    (lambda d: _set_u32(d, "llama.attention.head_count_kv", 3), "must be a multiple of llama.attention.head_count_kv"),
    (lambda d: _set_u32(d, "llama.block_count", 10**9), "describes 1000000000 layers, its weights hold 3"),
    (lambda d: _set_u32(d, "llama.embedding_length", 1 << 20), "weight embed has shape"),
    (lambda d: d.replace(b"blk.0.attn_q.weight", b"blk.X.attn_q.weight"), "tensor blk.X.attn_q.weight"),
], ids=["no-architecture", "no-width", "zero-heads", "kv-heads", "more-layers", "wider", "bad-name"])
def test_gguf_metadata(tiny_gguf_file, tmp_path, change, phrase):
    path = tmp_path / "m.gguf"
    path.write_bytes(change(tiny_gguf_file.read_bytes()))
    expect_error(lambda: load_fp32(path), str(path), phrase)


def test_gguf_without_any_metadata(tmp_path):
    import gguf

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].pop("general.architecture")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(lambda: load_fp32(path), str(path), "general.architecture")


def test_safetensors_named_gguf(tiny_llama, tmp_path):
    path = tmp_path / "weights.gguf"
    shutil.copy(tiny_llama.path / "model.safetensors", path)
    expect_error(lambda: load_fp32(path), str(path), "not a readable GGUF file")


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


# ---------------------------------------------------------------------------------------------------
# Draft files
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_file(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("draft") / "draft.safetensors"
    save_draft(build_draft(tiny_llama.lm.model, n_layers=1, keep=(1,), window=WindowSpec(1, 16)), path)
    return path


def _draft_parts(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def test_draft_loads(draft_file, tiny_llama):
    assert load_draft_file(draft_file, tiny_llama.lm, "fp32").config.n_layers == 1


def test_damaged_draft_file(draft_file, tiny_llama, tmp_path):
    data = draft_file.read_bytes()
    header = safetensors_header(data)
    for label, damaged in [*blind_damage(data, header), *header_flips(data, header)]:
        path = tmp_path / f"{label}.safetensors"
        path.write_bytes(damaged)
        error_or_load(lambda p=path: load_draft_file(p, tiny_llama.lm, "fp32"), str(path))
        if not label.startswith("flip"):
            expect_error(lambda p=path: load_draft_file(p, tiny_llama.lm, "fp32"), str(path), "not a readable")


def _config_change(change: Callable[[dict], object]) -> Callable[[dict, dict], None]:
    def apply(_state: dict, meta: dict) -> None:
        new = change(json.loads(meta["config"]))
        meta["config"] = new if isinstance(new, str) else json.dumps(new)
    return apply


BAD_DRAFTS: list[tuple[str, Callable[[dict, dict], None], str]] = [
    ("no-metadata", lambda s, m: m.clear(), "without specstack's draft metadata"),
    ("other-format", lambda s, m: m.update(format="pt"), "without specstack's draft metadata"),
    ("no-config", lambda s, m: m.pop("config"), "no config"),
    ("config-not-json", _config_change(lambda c: "{"), "its config is not JSON"),
    ("config-a-list", _config_change(lambda c: [c]), "no config"),
    ("zero-heads", _config_change(lambda c: {**c, "model": {**c["model"], "n_heads": 0}}), "n_heads must be >= 1"),
    ("negative-ff", _config_change(lambda c: {**c, "model": {**c["model"], "d_ff": -1}}), "d_ff must be >= 1"),
    ("no-window", _config_change(lambda c: {k: v for k, v in c.items() if k != "window"}), "malformed config"),
    ("unknown-field", _config_change(lambda c: {**c, "colour": "red"}), "malformed config"),
    ("bad-window", _config_change(lambda c: {**c, "window": {"sink": -1, "window": 0}}), "invalid sliding window"),
    ("target-layers", _config_change(lambda c: {**c, "target_layers": [99]}), "reads the target's layers [99]"),
    ("more-blocks", _config_change(lambda c: {**c, "model": {**c["model"], "n_layers": 3}, "target_layers": [1] * 3}),
     "its config describes 3 blocks, it holds 1"),
    ("layers-not-blocks", _config_change(lambda c: {**c, "target_layers": [1, 2]}), "one target layer per draft block"),
    ("no-vocab-ids", lambda s, m: s.pop("vocab_ids"), "vocab_ids"),
    ("float-vocab-ids", lambda s, m: s.update(vocab_ids=s["vocab_ids"].float()), "vocab_ids must be token ids"),
    ("vocab-ids-range", lambda s, m: s.update(vocab_ids=s["vocab_ids"] + 1000), "vocab_ids must be token ids"),
    ("weight-shape", lambda s, m: s.update({"norm": torch.zeros(3)}), "its weights do not fit its config"),
    ("weight-missing", lambda s, m: s.pop("norm"), "its weights do not fit its config"),
]


@pytest.mark.parametrize("label, change, phrase", BAD_DRAFTS, ids=[c[0] for c in BAD_DRAFTS])
def test_bad_draft_file(draft_file, tiny_llama, tmp_path, label, change, phrase):
    state, meta = _draft_parts(draft_file)
    change(state, meta)
    path = tmp_path / f"{label}.safetensors"
    save_file(state, str(path), metadata=meta)
    expect_error(lambda: load_draft_file(path, tiny_llama.lm, "fp32"), path.name, phrase)


@pytest.mark.parametrize("other", ["model.safetensors", "gguf"])
def test_draft_of_another_format(tiny_llama, tiny_gguf_file, tmp_path, other):
    path = tmp_path / "draft.safetensors"
    shutil.copy(tiny_llama.path / "model.safetensors" if other != "gguf" else tiny_gguf_file, path)
    phrase = "not a readable safetensors file" if other == "gguf" else "without specstack's draft metadata"
    expect_error(lambda: load_draft_file(path, tiny_llama.lm, "fp32"), str(path), phrase)


# ---------------------------------------------------------------------------------------------------
# Trigram files
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trigram_file(tmp_path_factory) -> Path:
    rng = random.Random(SEED)
    streams = [[rng.randrange(40) for _ in range(200)] for _ in range(5)]
    return KatzTrigram.train(streams, 257).save(tmp_path_factory.mktemp("trigram") / "t.npz")


def test_damaged_trigram(trigram_file, tmp_path):
    data = trigram_file.read_bytes()
    for label, damaged in [*blind_damage(data, 64), *header_flips(data, len(data))]:
        path = tmp_path / f"{label}.npz"
        path.write_bytes(damaged)
        if label.startswith("flip"):
            error_or_load(lambda p=path: KatzTrigram.load(p), str(path))
        else:
            expect_error(lambda p=path: KatzTrigram.load(p), str(path))


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


BAD_TRIGRAMS: list[tuple[str, Callable[[dict], None], str]] = [
    ("meta-not-json", lambda a: a.update(meta=np.array("{")), "cannot read n-gram file"),
    ("meta-a-list", lambda a: a.update(meta=np.array("[1]")), "unsupported format"),
    ("no-vocab", lambda a: a.update(meta=np.array(json.dumps({"format": 1, "k": 5}))), "vocab_size"),
    ("member-missing", lambda a: a.pop("tri_tok"), "tri_tok"),
    ("short-unigram", lambda a: a.update(unigram=a["unigram"][:10]), "the unigram must be 257"),
    ("nan-unigram", lambda a: a.update(unigram=a["unigram"] * np.nan), "the unigram must be 257"),
    ("offsets", lambda a: a.update(bi_off=a["bi_off"][::-1].copy()), "offsets must rise"),
    ("lengths", lambda a: a.update(tri_alpha=a["tri_alpha"][:-1]), "table lengths disagree"),
    ("token-range", lambda a: a.update(bi_tok=a["bi_tok"].astype(np.int64) + 300), "token ids must be in [0, 257)"),
    ("text-table", lambda a: a.update(bi_prob=a["bi_prob"].astype(str)), "1-D array of the right type"),
]


@pytest.mark.parametrize("label, change, phrase", BAD_TRIGRAMS, ids=[c[0] for c in BAD_TRIGRAMS])
def test_bad_trigram(trigram_file, tmp_path, label, change, phrase):
    arrays = _arrays(trigram_file)
    change(arrays)
    path = tmp_path / f"{label}.npz"
    np.savez(path, **arrays)
    expect_error(lambda: KatzTrigram.load(path), str(path), phrase)


def test_trigram_not_a_zip(tiny_llama, tmp_path):
    path = tmp_path / "t.npz"
    shutil.copy(tiny_llama.path / "config.json", path)
    expect_error(lambda: KatzTrigram.load(path), str(path))


# ---------------------------------------------------------------------------------------------------
# The command line: exit 2, one error line, no traceback
# ---------------------------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> CliResult:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return CliResult(code, out, err)


GENERATE = ("generate", "--prompt", "x", "--max-new-tokens", "1", "--dtype", "fp32")


def test_cli_corrupt_model(capsys, tiny_llama, tiny_gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    d = hf_copy(tiny_llama.path, tmp_path / "cut")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    assert_error(cli(capsys, *GENERATE, "--model", str(d)), f"model.safetensors in {d}")
    z = hf_copy(tiny_llama.path, tmp_path / "zero")
    (z / "config.json").write_text(json.dumps({**json.loads((z / "config.json").read_text()), "num_attention_heads": 0}))
    assert_error(cli(capsys, *GENERATE, "--model", str(z)), "num_attention_heads must be >= 1, got 0")
    g = tmp_path / "cut.gguf"
    g.write_bytes(tiny_gguf_file.read_bytes()[:300])
    assert_error(cli(capsys, *GENERATE, "--model", str(g)), str(g))


def test_cli_corrupt_draft(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "draft.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    r = cli(capsys, *GENERATE, "--model", str(tiny_model_dir), "--method", "chain:k=2", "--draft", str(bad))
    assert_error(r, f"draft file {bad}: not a readable safetensors file")
    other = tmp_path / "weights.safetensors"
    shutil.copy(tiny_model_dir / "model.safetensors", other)
    (tmp_path / "seq.safetensors").write_bytes(b"never read: the draft is checked first")
    r = cli(capsys, "draft-acceptance", str(other), "--sequences", str(tmp_path / "seq.safetensors"))
    assert_error(r, "without specstack's draft metadata")


def test_real_entry_point_on_a_corrupt_model(tiny_llama, tmp_path):
    d = hf_copy(tiny_llama.path, tmp_path / "m")
    (d / "config.json").write_text("[]")
    p = subprocess.run([sys.executable, "-m", "specstack.cli", *GENERATE, "--model", str(d)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SPECSTACK_CACHE": str(tmp_path / "c")})
    assert_error(CliResult(p.returncode, p.stdout, p.stderr), f"config.json in {d}: not a JSON object")
