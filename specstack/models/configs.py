"""A model's shape (ModelConfig) from its files, checked once: a Hugging Face `config.json`, GGUF
metadata, specstack's own cache and draft files all go through `model_config`.

A malformed file is one SpecstackError of the form `cannot load WHERE: WHAT` (`file_error`), WHERE
naming the file (`config.json in DIR`, the .gguf path) and WHAT the problem in the file's own terms
(`num_attention_heads must be >= 1, got 0`). Torch-free: commands read configs in their
checks before any model is built.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from specstack import validate
from specstack.config import BlockFeatures, ModelConfig
from specstack.errors import SpecstackError
from specstack.models import architectures
from specstack.models.architectures import GGUF_HEAD_DIM_KEYS, GGUF_KEYS, Family

SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
FIELDS = frozenset(f.name for f in fields(ModelConfig))

def file_error(where: str, problem: str) -> SpecstackError:
    """The one form of a malformed-file error."""
    return SpecstackError(f"cannot load {where}: {problem}")


def library_error(e: BaseException, limit: int = 120) -> str:
    """A library's exception for a file_error: its type and first line, cut short (some run to pages)."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def read_json_object(path: Path, where: str) -> dict[str, Any]:
    """The JSON object in `path` (UTF-8), or a file_error saying why there is none."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise file_error(where, e.strerror or str(e)) from None
    except UnicodeDecodeError as e:
        raise file_error(where, f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise file_error(where, f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise file_error(where, f"not a JSON object (a {type(value).__name__})")
    return value


# ---------------------------------------------------------------------------------------------------
# The one check
# ---------------------------------------------------------------------------------------------------
def checked_fields(f: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """ModelConfig fields `f`, each checked by validate's rules (a SpecstackError naming the field as the
    file spells it, through `names`). Runs before ModelConfig is built: it divides by the head counts."""
    def n(key: str) -> str:
        return (names or {}).get(key, key)

    unknown = sorted(set(f) - FIELDS)
    if unknown:
        validate.fail(", ".join(unknown), "is not a field of a model's config")
    arch = f.get("arch")
    fam = architectures.BY_NAME.get(arch) if isinstance(arch, str) else None  # a list would not even hash
    if fam is None:
        validate.fail(n("arch"), f"must be one of {', '.join(architectures.BY_NAME)}, got "
                                 f"{validate.shown(f.get('arch'))}")
    out = dict(f)
    block = f.get("block", fam.block)
    if isinstance(block, Mapping):
        try:
            block = BlockFeatures(**block)
        except TypeError as e:
            validate.fail(n("block"), f"is not a block's features ({e})")
    if not isinstance(block, BlockFeatures):
        validate.fail(n("block"), f"must be a block's features, got {validate.shown(block)}")
    out["block"] = block
    for key in SIZES:
        if f.get(key) is None:
            validate.fail(n(key), "is missing")
        high = validate.MAX_CONTEXT if key == "max_seq_len" else None
        out[key] = validate.bounded_int(n(key), f[key], 1, high, "longer than any model's context")
    out["head_dim"] = validate.bounded_int(n("head_dim"), f.get("head_dim", 0), 0)  # 0: d_model / n_heads
    d, heads, kv, head_dim = out["d_model"], out["n_heads"], out["n_kv_heads"], out["head_dim"]
    if heads % kv:
        validate.fail(n("n_heads"), f"({heads}) must be a multiple of {n('n_kv_heads')} ({kv})")
    if not head_dim and d % heads:
        validate.fail(n("d_model"), f"({d}) must be a multiple of {n('n_heads')} ({heads})")
    head_dim = head_dim or d // heads
    if block.position == "rope" and head_dim % 2:
        validate.fail("the head size", f"must be even (rotary embeddings turn pairs), got {head_dim}")
    if fam.hf_layout == "gpt2" and heads * head_dim != d:  # GPT-2 splits its fused qkv in d_model rows each
        validate.fail(n("n_heads"), f"x head size must be {n('d_model')} ({d}), got {heads} x {head_dim}")
    for key in ("norm_eps", "rope_theta"):
        if key in f:
            out[key] = validate.bounded_float(n(key), f[key], 0.0, low_open=True)
    if not isinstance(f.get("tie_embeddings", False), bool):
        validate.fail(n("tie_embeddings"), f"must be true or false, got {validate.shown(f['tie_embeddings'])}")
    if f.get("bos_token_id") is not None:
        out["bos_token_id"] = validate.bounded_int(n("bos_token_id"), f["bos_token_id"], 0)
    eos = f.get("eos_token_ids", ())
    if not isinstance(eos, list | tuple):
        validate.fail(n("eos_token_ids"), f"must be token ids, got {validate.shown(eos)}")
    out["eos_token_ids"] = tuple(validate.bounded_int(n("eos_token_ids"), t, 0) for t in eos)
    return out


def model_config(f: Mapping[str, Any], where: str, names: Mapping[str, str] | None = None) -> ModelConfig:
    """ModelConfig(**f), checked (checked_fields): a file_error naming `where` when it cannot be."""
    try:
        return ModelConfig(**checked_fields(f, names))
    except SpecstackError as e:
        raise file_error(where, str(e)) from None


# ---------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------------------
def _eos_ids(eos: Any) -> Any:
    """eos_token_id: one id, a list of ids, or absent."""
    return eos if isinstance(eos, list) else (() if eos is None else (eos,))


def config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """The config of a transformers checkpoint from its config.json's object (a family of the
    architecture table)."""
    mt = cfg.get("model_type")
    fam = architectures.BY_HF_TYPE.get(mt) if isinstance(mt, str) else None
    if fam is None:
        raise file_error(where, f"unsupported model type {mt!r}: specstack runs {architectures.names()} models")
    for key, what in fam.hf_unsupported.items():
        if cfg.get(key):
            raise file_error(where, f"{mt} checkpoints with {what} ({key}) are not supported")
    f: dict[str, Any] = {k: cfg.get(key) for k, key in fam.hf_keys.items()}
    f.update(arch=fam.name, block=fam.block)
    defaults: dict[str, Any] = dict(fam.hf_defaults)
    if fam.block.position == "rope":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise file_error(where, f"rope_scaling must be an object, got {rope!r}")
        if rope.get("rope_type", "default") not in ("default", None):
            raise file_error(where, f"rope scaling {rope.get('rope_type')!r} is not supported")
        f["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        f["head_dim"] = f.get("head_dim") or 0
        f["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
        defaults["n_kv_heads"] = f["n_heads"]
    else:  # GPT-2: tied, its MLP four times its width unless n_inner says otherwise
        f["tie_embeddings"] = True
        d = f["d_model"]
        defaults["d_ff"] = 4 * d if type(d) is int else None  # else d_model's error
    return model_config(_filled(f, defaults), where, fam.hf_keys)


def _filled(f: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`f` with each None replaced by its default, and eos_token_ids as a sequence."""
    out = {k: defaults[k] if v is None and k in defaults else v for k, v in f.items()}
    out["eos_token_ids"] = _eos_ids(out.get("eos_token_ids"))
    return out


def read_hf_config(path: Path) -> ModelConfig:
    """The config of the Hugging Face checkpoint directory `path`."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SpecstackError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    where = f"config.json in {path}"
    return config_from_hf(read_json_object(cfg_file, where), where)


# ---------------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------------
# what gguf's reader raises on a file that is not a well-formed GGUF (a bad magic, a truncated header,
# an unknown value type, undecodable names, tensor data running past the end)
GGUF_ERRORS = (OSError, ValueError, IndexError, KeyError, OverflowError)


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader of `path`, or a file_error when the file is not a readable GGUF."""
    import gguf  # deferred: an optional dependency, needed only for a .gguf file

    try:
        return gguf.GGUFReader(str(path))
    except GGUF_ERRORS as e:
        raise file_error(str(path), f"not a readable GGUF file ({library_error(e)})") from None


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_family(reader: Any, where: str) -> Family:
    """The family of a GGUF file, from its general.architecture."""
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise file_error(where, "its metadata has no general.architecture: not a model's GGUF")
    fam = architectures.BY_NAME.get(arch) if isinstance(arch, str) else None
    if fam is None or not fam.gguf:
        raise file_error(where, f"unsupported GGUF architecture {arch!r}: specstack reads "
                                f"{architectures.names('gguf')} GGUF files")
    return fam


def config_from_gguf(reader: Any, where: str) -> ModelConfig:
    """The config in a GGUF reader's metadata; `where` names the file in errors."""
    fam = gguf_family(reader, where)
    keys = {k: key.format(a=fam.name) for k, key in GGUF_KEYS.items()}
    f: dict[str, Any] = {k: _field(reader, key) for k, key in keys.items()}
    head_keys = [key.format(a=fam.name) for key in GGUF_HEAD_DIM_KEYS]
    keys["head_dim"] = next((key for key in head_keys if _field(reader, key) is not None), head_keys[0])
    f["head_dim"] = _field(reader, keys["head_dim"]) or 0
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    f.update(arch=fam.name, block=fam.block, tie_embeddings="output.weight" not in names)
    # no vocab_size key (llama.cpp writes none for qwen2): the embedding's rows, else the tokenizer's count
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight" and len(t.shape) == 2), None)
    vocab = int(embd.shape[1]) if embd is not None else len(tokens) if isinstance(tokens, list) else None
    defaults = {"vocab_size": vocab, "n_kv_heads": f["n_heads"],
                "max_seq_len": 2048, "norm_eps": 1e-5, "rope_theta": 10000.0}
    return model_config(_filled(f, defaults), where, keys)


def read_gguf_config(path: Path) -> ModelConfig:
    """The config in a GGUF file's metadata (its tensors are not read)."""
    return config_from_gguf(open_gguf(path), str(path))
