"""Load a model from a Hugging Face checkpoint directory / hub id or a GGUF file into the runner.

Sources are first mapped to *canonical weights* (names below, float tensors in [out, in] layout, or
Q4Weight for 4-bit GGUF blocks), then built into a Transformer in the requested format. The built
model is cached on disk (safetensors), keyed by the source file's identity, format and device type, so
the second load of a model is a file read.

Canonical names: embed, pos_embed (gpt2), layers.{i}.{attn_norm,mlp_norm}.{weight,bias},
layers.{i}.{q,k,v,o,gate,up,down}[.bias], norm.{weight,bias}, head (absent when tied).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specstack.config import DEVICES, WEIGHT_FORMATS, ModelConfig
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.registry import ModelSource, resolve
from specstack.models.transformer import Q4Weight, Transformer, Weight

CACHE_VERSION = "5"  # bump whenever the built layout changes


def cache_root() -> Path:
    return Path(os.environ.get("SPECSTACK_CACHE", Path.home() / ".cache" / "specstack"))


# ---------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------------
def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    mt = cfg.get("model_type")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if mt in ("llama", "mistral"):
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise SpecstackError(f"{mt} checkpoints with biases are not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise SpecstackError(f"rope scaling {rope.get('rope_type')!r} is not supported")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            arch="llama", vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads, d_ff=cfg["intermediate_size"],
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        )
    if mt == "gpt2":
        d = cfg["n_embd"]
        return ModelConfig(
            arch="gpt2", vocab_size=cfg["vocab_size"], d_model=d, n_layers=cfg["n_layer"],
            n_heads=cfg["n_head"], n_kv_heads=cfg["n_head"], d_ff=cfg.get("n_inner") or 4 * d,
            max_seq_len=cfg["n_positions"], norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=True, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        )
    raise SpecstackError(f"unsupported model type {mt!r}: specstack runs llama/mistral and gpt2 models")


def canonical_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, Weight]:
    """Map a transformers state dict to canonical names (explicit, with shape checks at build time)."""
    out: dict[str, Weight] = {}
    if cfg.arch == "llama":
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        out["embed"] = sd["embed_tokens.weight"]
        for i in range(cfg.n_layers):
            p, q = f"layers.{i}.", f"layers.{i}."
            out[q + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
            out[q + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
            for n in ("q", "k", "v", "o"):
                out[q + n] = sd[f"{p}self_attn.{n}_proj.weight"]
            for n in ("gate", "up", "down"):
                out[q + n] = sd[f"{p}mlp.{n}_proj.weight"]
        out["norm.weight"] = sd["norm.weight"]
        if "lm_head.weight" in sd and not cfg.tie_embeddings:
            out["head"] = sd["lm_head.weight"]
        return out
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    out["embed"], out["pos_embed"] = sd["wte.weight"], sd["wpe.weight"]
    d = cfg.d_model
    for i in range(cfg.n_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        for src, dst in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[q + dst + ".weight"], out[q + dst + ".bias"] = sd[p + src + ".weight"], sd[p + src + ".bias"]
        # GPT-2's Conv1D stores [in, out]: transpose to the [out, in] of a linear layer.
        qkv_w, qkv_b = sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]
        for j, n in enumerate(("q", "k", "v")):
            out[q + n], out[q + n + ".bias"] = qkv_w[j * d : (j + 1) * d], qkv_b[j * d : (j + 1) * d]
        out[q + "o"], out[q + "o.bias"] = sd[p + "attn.c_proj.weight"].t(), sd[p + "attn.c_proj.bias"]
        out[q + "up"], out[q + "up.bias"] = sd[p + "mlp.c_fc.weight"].t(), sd[p + "mlp.c_fc.bias"]
        out[q + "down"], out[q + "down.bias"] = sd[p + "mlp.c_proj.weight"].t(), sd[p + "mlp.c_proj.bias"]
    out["norm.weight"], out["norm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return out


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, Weight]]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SpecstackError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    sd: dict[str, torch.Tensor] = {}
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        from safetensors.torch import load_file

        for f in st_files:
            sd.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").is_file():
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise SpecstackError(f"{path} has no *.safetensors or pytorch_model.bin weights")
    sd = {k: v.float() for k, v in sd.items()}
    return cfg, canonical_from_hf(sd, cfg)


# ---------------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------------
def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SpecstackError(f"unsupported GGUF architecture {arch!r}: only llama GGUF files are supported")
    a = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    n_heads = a("attention.head_count")
    d_model = a("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch="llama", vocab_size=vocab, d_model=d_model, n_layers=a("block_count"), n_heads=n_heads,
        n_kv_heads=a("attention.head_count_kv", n_heads), d_ff=a("feed_forward_length"),
        max_seq_len=a("context_length", 2048), head_dim=a("rope.dimension_count", d_model // n_heads),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(a("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in names, bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
    )


def _gguf_tensor(t: Any) -> Weight:
    """One GGUF tensor as [rows, cols]: Q4_1 stays 4-bit (Q4Weight), everything else is dequantised."""
    import gguf

    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    cols = int(t.shape[0])
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // 32, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles first
        return Q4Weight(torch.from_numpy(q), torch.from_numpy(d.astype(np.float32)),
                        torch.from_numpy(m.astype(np.float32)))
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    w = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a writable copy: GGUF data is a read-only map
    return w.reshape(rows, cols) if len(t.shape) > 1 else w.reshape(cols)


def _unpermute_rope(w: Weight, n_heads: int) -> Weight:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it (rows only, so
    4-bit blocks, which run along the input dimension, move intact)."""
    def rows(x: torch.Tensor) -> torch.Tensor:
        r = x.shape[0]
        return x.reshape(n_heads, r // n_heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)

    if isinstance(w, Q4Weight):
        return Q4Weight(rows(w.q), rows(w.d), rows(w.m))
    return rows(w)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, Weight]]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises assorted errors for non-GGUF files
        raise SpecstackError(f"{path} is not a readable GGUF file ({e})") from None
    cfg = config_from_gguf(reader)
    names = {"token_embd.weight": "embed", "output_norm.weight": "norm.weight", "output.weight": "head"}
    per_layer = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "mlp_norm.weight",
                 "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
                 "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down"}
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        if t.name in names:
            key = names[t.name]
        elif t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            if rest not in per_layer:
                raise SpecstackError(f"unexpected GGUF tensor {t.name}")
            key = f"layers.{i}.{per_layer[rest]}"
        else:
            continue  # e.g. rope_freqs: derived from the config here
        w = _gguf_tensor(t)
        if key.endswith(".q"):
            w = _unpermute_rope(w, cfg.n_heads)
        elif key.endswith(".k"):
            w = _unpermute_rope(w, cfg.n_kv_heads)
        out[key] = w
    return cfg, out


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------
def load_tokenizer(src: ModelSource, cache_dir: Path | None) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    if cache_dir is not None and (cache_dir / "tokenizer").is_dir():
        return AutoTokenizer.from_pretrained(str(cache_dir / "tokenizer"))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if src.kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(src.path))
    except Exception as e:
        raise SpecstackError(f"cannot load a tokenizer for {src.name}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if cache_dir is not None:
        tok.save_pretrained(str(cache_dir / "tokenizer"))
    return tok


# ---------------------------------------------------------------------------------------------------
# The whole load, with the on-disk cache
# ---------------------------------------------------------------------------------------------------
def model_cache_dir(src: ModelSource, root: Path | None = None) -> Path:
    """The folder where `load_model` keeps `src`'s converted weights and tokenizer: named by the
    source and keyed by its files' identity (path, size, mtime) and the cache layout's version."""
    return (root or cache_root()) / f"{src.name.replace('/', '--')}-{_source_key(src)}"


def _source_key(src: ModelSource) -> str:
    files = [src.path] if src.path.is_file() else sorted(p for p in src.path.iterdir() if p.is_file())
    h = hashlib.sha256(CACHE_VERSION.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def read_source(src: ModelSource) -> tuple[ModelConfig, dict[str, Weight]]:
    return read_gguf(src.path) if src.kind == "gguf" else read_hf_dir(src.path)


def load_model(name: str, dtype: str = "bf16", device: str = "cpu", use_cache: bool = True,
               tokenizer: bool = True) -> LoadedModel:
    """Load a named model (registry), a .gguf file, or a Hugging Face directory / hub id."""
    if dtype not in WEIGHT_FORMATS:
        raise SpecstackError(f"unsupported dtype {dtype!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    if device not in DEVICES:
        raise SpecstackError(f"unsupported device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecstackError("device 'cuda' requested but no CUDA device is available")
    src = resolve(name)
    cdir = model_cache_dir(src) if use_cache else None
    built = cdir / f"{dtype}-{device}.safetensors" if cdir else None
    if built is not None and built.is_file():
        from safetensors.torch import load_file

        cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in json.loads((cdir / "config.json").read_text()).items()})
        with torch.device(device):  # int4 packing is device-specific: build where the model runs
            model = Transformer(cfg, dtype)
        model.load_state_dict(load_file(str(built), device=device), strict=True)
    else:
        try:
            cfg, weights = read_source(src)
            with torch.device(device):
                model = Transformer(cfg, dtype)
            model.load_weights(weights)
        except (KeyError, ValueError) as e:  # a checkpoint that does not match its config
            what = f"missing entry {e}" if isinstance(e, KeyError) else str(e)
            raise SpecstackError(f"cannot load {src.name} from {src.path}: {what}") from None
        del weights
        if built is not None:
            from safetensors.torch import save_file

            cdir.mkdir(parents=True, exist_ok=True)
            (cdir / "config.json").write_text(json.dumps(asdict(cfg)))
            tmp = built.with_suffix(".tmp")
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
            tmp.replace(built)  # atomic: an interrupted save never leaves a half-written cache
    model = model.to(device).eval()
    tok = load_tokenizer(src, cdir) if tokenizer and src.has_tokenizer else None
    return LoadedModel(src.name, model, tok, cfg, dtype, source=name)
