"""Load a model from a Hugging Face checkpoint directory / hub id or a GGUF file into the runner.

Sources are first mapped to *canonical weights* (names below, float tensors in [out, in] layout, or
Q4Weight for 4-bit GGUF blocks), then built into a Transformer in the requested format. The built
model is cached on disk (safetensors), in a folder keyed by the source's bytes (models/model_cache), a
file per format and device type, so the second load of a model is a file read.

Canonical names: embed, pos_embed (gpt2), layers.{i}.{attn_norm,mlp_norm}.{weight,bias},
layers.{i}.{q,k,v,o,gate,up,down}[.bias], norm.{weight,bias}, head (absent when tied).
"""
from __future__ import annotations

import json
import pickle
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specstack.config import DEVICES, ModelConfig
from specstack.errors import SpecstackError
from specstack.files import cache_root  # also re-exported: the engine's stores use it
from specstack.models import model_cache
from specstack.models.architectures import GGUF_BLOCK_TENSORS, GGUF_TOP_TENSORS, block_shapes, family
from specstack.models.base import LoadedModel
from specstack.models.configs import (
    config_from_gguf,
    file_error,
    library_error,
    model_config,
    open_gguf,
    read_hf_config,
    read_json_object,
)
from specstack.models.gguf_quants import layer_format, read_tensor
from specstack.models.huge_pages import move_to_huge_pages
from specstack.models.quant import layout_variant, slow_layer_formats
from specstack.models.registry import ModelSource, resolve
from specstack.models.transformer import Transformer, Weight
from specstack.weight_formats import FORMATS, head_format, requested_format, weight_format


# ---------------------------------------------------------------------------------------------------
# What a source must hold
# ---------------------------------------------------------------------------------------------------
def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight a model of `cfg` is built from, with its shape ([out, in] for a matrix);
    `head` only when the embeddings are not tied."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, d), "norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["head"] = (cfg.vocab_size, d)
    if cfg.block.position == "learned":
        shapes["pos_embed"] = (cfg.max_seq_len, d)
    if cfg.block.norm == "layer":
        shapes["norm.bias"] = (d,)
    block = block_shapes(d, cfg.q_dim, cfg.kv_dim, cfg.d_ff, cfg.head_dim, cfg.block)
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def _shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


def check_layer_count(cfg: ModelConfig, names: Iterable[str], where: str) -> None:
    """The layers the weights hold against the config's count: first, since a damaged count would
    otherwise list (or plan, or allocate) that many layers."""
    layers = {k.split(".")[1] for k in names if k.startswith("layers.")}
    if len(layers) != cfg.n_layers:
        raise file_error(where, f"its config describes {cfg.n_layers} layers, its weights hold {len(layers)}")


def check_weights(cfg: ModelConfig, weights: dict[str, Weight], where: str) -> None:
    """The weights a source holds against the shapes its config gives them, before a model of that
    config is allocated (a damaged size would otherwise allocate it first, or fail inside torch)."""
    check_layer_count(cfg, weights, where)
    expected = canonical_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights:
            if name == "head":  # an untied config without its own head: the embedding serves (load_weights)
                continue
            raise file_error(where, f"weight {name} is missing (the config describes a {cfg.arch} of "
                                    f"{cfg.n_layers} layers)")
        if _shape(weights[name]) != shape:
            raise file_error(where, f"weight {name} has shape {list(_shape(weights[name]))}, its config "
                                    f"gives {list(shape)}")
    unused = sorted(set(weights) - set(expected))
    if unused:
        raise file_error(where, f"weights the config has no place for: {', '.join(unused[:5])}")


# ---------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------------
# canonical name in a block -> its name in a Llama-layout state dict (llama, mistral, qwen2, qwen3)
HF_LLAMA_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                  **{n: f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")},
                  **{f"{n}.bias": f"self_attn.{n}_proj.bias" for n in ("q", "k", "v", "o")},
                  **{n: f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
                  **{f"{n}.bias": f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")},
                  "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight"}


def canonical_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, Weight]:
    """Map a transformers state dict to canonical names (a missing tensor is a KeyError naming it)."""
    out: dict[str, Weight] = {}
    if family(cfg.arch).hf_layout == "llama":
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        out["embed"] = sd["embed_tokens.weight"]
        block = block_shapes(cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff, cfg.head_dim, cfg.block)
        for i in range(cfg.n_layers):
            for name in block:
                out[f"layers.{i}.{name}"] = sd[f"layers.{i}.{HF_LLAMA_BLOCK[name]}"]
        out["norm.weight"] = sd["norm.weight"]
        if "lm_head.weight" in sd and not cfg.tie_embeddings:
            out["head"] = sd["lm_head.weight"]
        return out
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    out["embed"], out["pos_embed"] = sd["wte.weight"], sd["wpe.weight"]
    d = cfg.d_model

    def conv1d(name: str) -> torch.Tensor:
        # GPT-2's Conv1D stores [in, out]: transpose to the [out, in] of a linear layer.
        w = sd[name]
        if w.dim() != 2:
            raise ValueError(f"{name} has shape {list(w.shape)}: a Conv1D weight is a matrix")
        return w.t()

    for i in range(cfg.n_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        for src, dst in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[q + dst + ".weight"], out[q + dst + ".bias"] = sd[p + src + ".weight"], sd[p + src + ".bias"]
        qkv_w, qkv_b = conv1d(p + "attn.c_attn.weight"), sd[p + "attn.c_attn.bias"]
        for j, n in enumerate(("q", "k", "v")):
            out[q + n], out[q + n + ".bias"] = qkv_w[j * d : (j + 1) * d], qkv_b[j * d : (j + 1) * d]
        out[q + "o"], out[q + "o.bias"] = conv1d(p + "attn.c_proj.weight"), sd[p + "attn.c_proj.bias"]
        out[q + "up"], out[q + "up.bias"] = conv1d(p + "mlp.c_fc.weight"), sd[p + "mlp.c_fc.bias"]
        out[q + "down"], out[q + "down.bias"] = conv1d(p + "mlp.c_proj.weight"), sd[p + "mlp.c_proj.bias"]
    out["norm.weight"], out["norm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return out


# what torch.load raises on a pytorch_model.bin that is not one (not a zip or a pickle, truncated)
TORCH_LOAD_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, OSError)


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory `path` (its *.safetensors, else its pytorch_model.bin)."""
    sd: dict[str, torch.Tensor] = {}
    st_files = sorted(path.glob("*.safetensors"))
    for f in st_files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise file_error(f"{f.name} in {path}", f"not a readable safetensors file ({library_error(e)})") from None
    if st_files:
        return sd
    if not (path / "pytorch_model.bin").is_file():
        raise SpecstackError(f"{path} has no *.safetensors or pytorch_model.bin weights")
    where = f"pytorch_model.bin in {path}"
    try:
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except TORCH_LOAD_ERRORS as e:
        raise file_error(where, f"not a readable PyTorch checkpoint ({library_error(e)})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise file_error(where, "not a state dict (names -> tensors)")
    return sd


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, Weight]]:
    cfg = read_hf_config(path)
    sd = {k: v.float() for k, v in read_hf_weights(path).items()}
    where = f"the weights in {path}"
    try:
        return cfg, canonical_from_hf(sd, cfg)
    except KeyError as e:
        raise file_error(where, f"tensor {e.args[0]} is missing (its config.json describes a {cfg.arch} of "
                                f"{cfg.n_layers} layers)") from None
    except ValueError as e:
        raise file_error(where, str(e)) from None


# ---------------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------------
def _unpermute_rope(w: Weight, n_heads: int) -> Weight:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it (rows only, so
    4-bit blocks, which run along the input dimension, move intact)."""
    if _shape(w)[0] % (2 * n_heads):
        raise ValueError(f"{_shape(w)[0]} rows do not split into {n_heads} heads of rotary pairs")

    def rows(x: torch.Tensor) -> torch.Tensor:
        r = x.shape[0]
        return x.reshape(n_heads, r // n_heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)

    return rows(w) if isinstance(w, torch.Tensor) else w.map_rows(rows)


GGUF_NAMES = {gguf_name: name for name, gguf_name in GGUF_TOP_TENSORS.items()}
GGUF_BLOCK_NAMES = {gguf_name: name for name, gguf_name in GGUF_BLOCK_TENSORS.items()}


def _gguf_name(name: str) -> str | None:
    """The canonical name of a GGUF tensor; None for one derived from the config here (rope_freqs)."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    if not name.startswith("blk."):
        return None
    _, i, rest = (name.split(".", 2) + ["", ""])[:3]
    if not i.isdigit() or rest not in GGUF_BLOCK_NAMES:
        raise ValueError("not a tensor of a decoder block")
    return f"layers.{i}.{GGUF_BLOCK_NAMES[rest]}"


def layer_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """Each linear layer of a model of `cfg` ("layers.{i}.qkv", ..., "head") -> the canonical weights
    it is fused from (the head: `head`, or `embed` when tied)."""
    up = ["gate", "up"] if cfg.block.gated else ["up"]
    parts = {"head": ["embed" if cfg.tie_embeddings else "head"]}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        parts.update({p + "qkv": [p + "q", p + "k", p + "v"], p + "o": [p + "o"], p + "up": [p + n for n in up],
                      p + "down": [p + "down"]})
    return parts


def plan_formats(cfg: ModelConfig, fmt: str, types: Mapping[str, str]) -> dict[str, str]:
    """The layers whose format differs from `fmt`, given each canonical weight's GGUF type: a fused
    layer takes the widest format its parts need (models/gguf_quants.py); the head is int8 at least
    under int4, q8a8 under w4a8 (weight_formats.head_format)."""
    out: dict[str, str] = {}
    slow = slow_layer_formats(fmt)
    for layer, parts in layer_parts(cfg).items():
        base = head_format(fmt) if layer == "head" else fmt
        f = layer_format(base, [types.get(p, "F32") for p in parts], slow)
        if f != fmt:
            out[layer] = f
    return out


def read_gguf(path: Path, fmt: str = "fp32") -> tuple[ModelConfig, dict[str, Weight], dict[str, str]]:
    """The config, canonical weights and per-layer formats (`plan_formats`) of a GGUF file for a model
    in `fmt`: the weights of int4 layers keep their 4-bit codes where their type allows."""
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, str(path))
    fam = family(cfg.arch)
    named: list[tuple[str, Any]] = []
    for t in reader.tensors:
        try:
            key = _gguf_name(t.name)
        except ValueError as e:
            raise file_error(str(path), f"tensor {t.name}: {e}") from None
        if key is not None:
            named.append((key, t))
    check_layer_count(cfg, (key for key, _ in named), str(path))
    formats = plan_formats(cfg, fmt, {key: t.tensor_type.name for key, t in named})
    int4_weights = {p for layer, parts in layer_parts(cfg).items() if FORMATS[formats.get(layer, fmt)].takes_codes
                    for p in parts}
    out: dict[str, Weight] = {}
    for key, t in named:
        try:
            w = read_tensor(t, want_codes=key in int4_weights)
            if fam.gguf_permuted_qk and key.endswith((".q", ".k")):
                w = _unpermute_rope(w, cfg.n_heads if key.endswith(".q") else cfg.n_kv_heads)
        except (ValueError, NotImplementedError) as e:  # a shape its data does not fill, an unknown type
            raise file_error(str(path), f"tensor {t.name}: {library_error(e)}") from None
        out[key] = w
    return cfg, out, formats


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------
def load_tokenizer(src: ModelSource, cache_dir: Path | None) -> Any:
    """`src`'s tokenizer, from `cache_dir` when it is there (a damaged copy is replaced), saved there
    otherwise."""
    from transformers import AutoTokenizer

    cached = cache_dir / "tokenizer" if cache_dir is not None else None
    if cached is not None and cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):  # a file missing or damaged (its JSON or text errors are ValueErrors)
            shutil.rmtree(cached, ignore_errors=True)
    tok = _source_tokenizer(src)
    if cached is not None:
        _cache_tokenizer(tok, cached)
    return tok


def _source_tokenizer(src: ModelSource) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if src.kind == "gguf":
            return AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
        return AutoTokenizer.from_pretrained(str(src.path))
    except Exception as e:
        raise SpecstackError(f"cannot load a tokenizer for {src.name}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _cache_tokenizer(tok: Any, cached: Path) -> None:
    """Save whole or not at all: into a new folder, then renamed; an interrupted save leaves nothing."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix="tokenizer-"))
    try:
        tok.save_pretrained(str(tmp))
        tmp.replace(cached)
    except OSError:  # another process renamed its copy first (that one stays), or the disk is full: no cache
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed


# ---------------------------------------------------------------------------------------------------
# The whole load, with the on-disk cache
# ---------------------------------------------------------------------------------------------------
def model_cache_dir(src: ModelSource, root: Path | None = None) -> Path:
    """The folder where `load_model` keeps `src`'s converted weights and tokenizer: named by the source
    and keyed by its bytes (models/model_cache.find; it may not exist yet)."""
    return model_cache.find(src, root)


def read_source(src: ModelSource, fmt: str = "fp32") -> tuple[ModelConfig, dict[str, Weight], dict[str, str]]:
    """The config, canonical weights and per-layer formats (`plan_formats`) of `src` for a model in
    `fmt`, the weights checked against the config."""
    if src.kind == "gguf":
        cfg, weights, formats = read_gguf(src.path, fmt)
    else:
        cfg, weights = read_hf_dir(src.path)
        formats = plan_formats(cfg, fmt, {})
    check_weights(cfg, weights, str(src.path) if src.kind == "gguf" else f"the weights in {src.path}")
    return cfg, weights, formats


CACHED_CONFIG = "the cached config"


def _built_file(cdir: Path, dtype: str, device: str) -> Path:
    """A format whose layout changed carries its revision in the name, so a model built under the old
    layout is rebuilt, never loaded with it (weight_formats: `revision`)."""
    rev = weight_format(dtype).revision
    return cdir / f"{dtype}{'' if rev is None else f'.r{rev}'}{layout_variant(dtype)}-{device}.safetensors"


def _load_built(cdir: Path, dtype: str, device: str) -> tuple[ModelConfig, Transformer] | None:
    """The model cached in `cdir` for `dtype` and `device`, or None when there is none or it is damaged
    (unreadable, or not the shape of its config): the caller then rebuilds it from the source, replacing
    the damaged files."""
    built = _built_file(cdir, dtype, device)
    if not built.is_file():
        return None
    try:
        cfg = model_config(read_json_object(cdir / "config.json", CACHED_CONFIG), CACHED_CONFIG)
        with safe_open(str(built), "pt") as f:
            formats = json.loads((f.metadata() or {}).get("formats", "{}"))
        state = load_file(str(built), device=device)
    except (SpecstackError, SafetensorError, OSError, ValueError):
        return None
    with torch.device(device):  # int4 packing is device-specific: build where the model runs
        model = Transformer(cfg, dtype, formats)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:  # what load_state_dict raises for missing, unexpected or misshapen tensors
        return None
    return cfg, model


def _cache_folder(src: ModelSource) -> Path | None:
    """`src`'s cache folder, existing and with `src` recorded in it before anything is built there; None
    (with a warning: this load converts without a cache) when the cache folder cannot be written."""
    try:
        cdir = model_cache_dir(src)
        model_cache.claim(src, cdir)
    except OSError as e:
        print(f"specstack: warning: the cache folder {cache_root()} cannot be used ({e.strerror or e}); the model "
              "is converted without it", file=sys.stderr, flush=True)
        return None
    return cdir


def _save_built(cdir: Path, dtype: str, device: str, cfg: ModelConfig, model: Transformer) -> None:
    """Cache a built model; each file is written whole or not at all (temp file, then rename), and an
    interrupted save leaves no temp file. A cache that cannot be written (a full disk, a read-only
    folder) costs a warning and the next load's conversion, never this load."""
    try:
        _write_built(cdir, dtype, device, cfg, model)
    except (OSError, SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"specstack: warning: the converted model was not cached in {cdir} ({reason}); the next load "
              "converts it again", file=sys.stderr, flush=True)


def _write_built(cdir: Path, dtype: str, device: str, cfg: ModelConfig, model: Transformer) -> None:
    built = _built_file(cdir, dtype, device)
    cfg_tmp, tmp = cdir / "config.json.tmp", built.with_suffix(".tmp")
    try:
        cfg_tmp.write_text(json.dumps(asdict(cfg)))
        cfg_tmp.replace(cdir / "config.json")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={"formats": json.dumps(model.formats)})
        tmp.replace(built)
    finally:
        cfg_tmp.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def load_model(name: str, dtype: str = "bf16", device: str = "cpu", use_cache: bool = True,
               tokenizer: bool = True) -> LoadedModel:
    """Load a named model (registry), a .gguf file, or a Hugging Face directory / hub id. A malformed
    source is a SpecstackError naming the file; a damaged cache is rebuilt from the source."""
    spec = requested_format(dtype, "dtype")
    if device not in DEVICES:
        raise SpecstackError(f"unsupported device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecstackError("device 'cuda' requested but no CUDA device is available")
    if device == "cuda" and spec.cpu_only:
        raise SpecstackError(f"{dtype} has no CUDA kernel (its kernels are CPU code: on cuda it would run its "
                             "float64 reference, row by row); use --dtype bf16 or fp32 on cuda")
    src = resolve(name)
    cdir = _cache_folder(src) if use_cache else None
    cached = _load_built(cdir, dtype, device) if cdir is not None else None
    if cached is not None:
        cfg, model = cached
    else:
        cfg, weights, formats = read_source(src, dtype)
        with torch.device(device):
            model = Transformer(cfg, dtype, formats)
        model.load_weights(weights)
        del weights
        if cdir is not None:
            _save_built(cdir, dtype, device, cfg, model)
    model = model.to(device).eval()
    move_to_huge_pages(model.buffers())  # what a step streams (codes, scales, head): not the embedding, a parameter
    tok = load_tokenizer(src, cdir) if tokenizer and src.has_tokenizer else None
    return LoadedModel(src.name, model, tok, cfg, dtype, source=name)
