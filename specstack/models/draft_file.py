"""A trained draft on disk: one safetensors file with the draft's own weights (blocks, final norm,
vocabulary ids) and its SpireConfig in the metadata. The embedding and unembedding are the target's,
shared at load time, so the file stays small (DESIGN §7, the shipped default ≤ 25 MB)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specstack.errors import SpecstackError
from specstack.files import atomic_output
from specstack.models.base import LoadedModel
from specstack.models.configs import file_error, library_error, model_config
from specstack.models.linear_methods import activation_dtype
from specstack.models.spire_draft import SpireConfig, SpireDraft
from specstack.models.transformer import Transformer, rope_tables
from specstack.weight_formats import requested_format, weight_format

DRAFT_FORMAT = "specstack-spire-draft"  # the metadata's `format` of a draft file


def shared_weights(target: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and unembedding as float [V, d] (the embedding itself when tied)."""
    embed = target.embed.detach()
    if target.config.tie_embeddings:
        return embed, embed
    return embed, target.head.float_weight().to(embed.dtype)  # any format: its weight as the kernel sees it


def save_draft(model: SpireDraft, path: Path, info: dict[str, str] | None = None) -> None:
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    meta = {"format": DRAFT_FORMAT, "config": model.spire.to_json(), **(info or {})}
    with atomic_output(path) as tmp:
        save_file(state, str(tmp), metadata=meta)


@dataclass(frozen=True)
class DraftHeader:
    """What a draft file says about itself, read without its weights."""

    config: SpireConfig
    vocab: int  # rows of the draft's own unembedding (its vocab_ids)
    info: dict[str, str]  # the whole metadata


def read_draft_header(path: str | Path) -> DraftHeader:
    """The header of a draft file from `specstack train-draft`; a SpecstackError naming the file when it
    is missing, not a safetensors file, or one without a draft's metadata."""
    p = Path(path)
    if not p.is_file():
        raise SpecstackError(f"draft file not found: {p}")
    where = f"draft file {p}"
    try:
        with safe_open(str(p), "pt") as f:
            meta = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise file_error(where, f"not a readable safetensors file ({library_error(e)})") from None
    if meta.get("format") != DRAFT_FORMAT:
        raise file_error(where, "a safetensors file without specstack's draft metadata (drafts are made by "
                                "`specstack train-draft`)")
    config = _spire_config(meta.get("config"), where)
    vocab = shapes.get("vocab_ids")
    if vocab is None or len(vocab) != 1 or not 1 <= vocab[0] <= config.model.vocab_size:
        raise file_error(where, f"vocab_ids must hold 1 to {config.model.vocab_size} token ids, found shape "
                                f"{None if vocab is None else list(vocab)}")
    blocks = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if len(blocks) != config.model.n_layers:
        raise file_error(where, f"its config describes {config.model.n_layers} blocks, it holds {len(blocks)}")
    return DraftHeader(config, vocab[0], meta)


def _spire_config(text: str | None, where: str) -> SpireConfig:
    """The SpireConfig in a draft's metadata, its model shape checked like any model's (configs.model_config,
    first: SpireConfig.from_json builds it unchecked, dividing by its head counts)."""
    if text is None:
        raise file_error(where, "its metadata has no config with a model shape")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise file_error(where, f"its config is not JSON ({library_error(e)})") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        raise file_error(where, "its metadata has no config with a model shape")
    checked = model_config(model, f"{where} (its config)")
    try:
        return replace(SpireConfig.from_json(text), model=checked)
    except (KeyError, TypeError, ValueError) as e:  # a field missing, unknown or of the wrong type
        raise file_error(where, f"malformed config ({library_error(e)})") from None
    except SpecstackError as e:  # SpireConfig's or WindowSpec's own checks
        raise file_error(where, str(e)) from None


def load_draft_file(path: str | Path, target: LoadedModel, fmt: str = "bf16") -> LoadedModel:
    """The draft in `path`, sharing `target`'s embedding and unembedding, its weights in `fmt`
    (fp32, bf16, or int8 / int4 for inference: see SpireDraft.quantize_)."""
    requested_format(fmt, "draft weight format")  # before any reading
    p = Path(path)
    config = read_draft_header(p).config
    where = f"draft file {p}"
    tc, dc = target.config, config.model
    if (tc.vocab_size, tc.d_model) != (dc.vocab_size, dc.d_model):
        raise SpecstackError(f"draft {p.name} was trained for a target with vocabulary {dc.vocab_size} and width "
                             f"{dc.d_model}; {target.name} has {tc.vocab_size} and {tc.d_model}")
    if not all(isinstance(i, int) and 0 <= i <= tc.n_layers for i in config.target_layers):
        raise SpecstackError(f"draft {p.name} reads the target's layers {list(config.target_layers)}; "
                             f"{target.name} has layers 0..{tc.n_layers}")
    state = load_file(str(p))
    ids = state["vocab_ids"]
    if ids.is_floating_point() or int(ids.min()) < 0 or int(ids.max()) >= dc.vocab_size:
        raise file_error(where, f"vocab_ids must be token ids in [0, {dc.vocab_size})")
    model = SpireDraft(config, ids)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # what load_state_dict raises for missing, unexpected or misshapen tensors
        detail = " ".join(str(e).split("\n", 1)[-1].split())[:300]  # after "Error(s) in loading state_dict ...:"
        raise file_error(where, f"its weights do not fit its config ({detail})") from None
    dtype = activation_dtype(fmt)
    model = model.to(dtype=dtype, device=target.model.device).eval()
    model.rope_cos, model.rope_signed_sin = (t.to(target.model.device) for t in rope_tables(config.model))  # fp32
    if not isinstance(target.model, Transformer):
        raise SpecstackError(f"draft {p.name} shares the embeddings of a Transformer target; {target.name} is not one")
    model.attach_target(*shared_weights(target.model))
    for prm in model.parameters():
        prm.requires_grad_(False)
    if not weight_format(fmt).floats:  # a quantised format, from the float weights the file holds
        model.quantize_(fmt)
    return LoadedModel(f"spire:{p.stem}", model, None, config.model, fmt, source=str(p))


def draft_info(path: str | Path) -> dict[str, str]:
    """A draft file's metadata: its config, and how it was made (`specstack train-draft`)."""
    return read_draft_header(path).info
