"""A trained draft on disk: one safetensors file with the draft's own weights (blocks, final norm,
vocabulary ids) and its SpireConfig in the metadata. The embedding and unembedding are the target's,
shared at load time, so the file stays small (DESIGN §7, the shipped default ≤ 25 MB)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specstack.config import WEIGHT_FORMATS
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.drafts import FILE_SUFFIX
from specstack.models.quant import activation_dtype
from specstack.models.spire_draft import SpireConfig, SpireDraft
from specstack.models.transformer import Transformer, rope_tables


def shared_weights(target: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and unembedding as float [V, d] (the embedding itself when tied)."""
    embed = target.embed.detach()
    if target.config.tie_embeddings:
        return embed, embed
    head = target.head
    if head.fmt in ("fp32", "bf16"):
        return embed, head.weight
    if head.fmt == "int8":
        return embed, (head.weight.float() * head.scales.float()[:, None]).to(embed.dtype)
    raise SpecstackError(f"cannot share a {head.fmt} unembedding with a draft")


def save_draft(model: SpireDraft, path: Path, info: dict[str, str] | None = None) -> None:
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    meta = {"format": "specstack-spire-draft", "config": model.spire.to_json(), **(info or {})}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(path)


def is_draft_file(path: str | Path) -> bool:
    p = Path(path)
    if p.suffix != FILE_SUFFIX or not p.is_file():
        return False
    with safe_open(str(p), "pt") as f:
        return (f.metadata() or {}).get("format") == "specstack-spire-draft"


def load_draft_file(path: str | Path, target: LoadedModel, fmt: str = "bf16") -> LoadedModel:
    """The draft in `path`, sharing `target`'s embedding and unembedding, its weights in `fmt`
    (fp32, bf16, or int8 / int4 for inference: see SpireDraft.quantize_)."""
    if fmt not in WEIGHT_FORMATS:  # before any reading
        raise SpecstackError(f"unsupported draft weight format {fmt!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    p = Path(path)
    if not p.is_file():
        raise SpecstackError(f"draft file not found: {p}")
    with safe_open(str(p), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "specstack-spire-draft":
        raise SpecstackError(f"{p} is not a specstack draft file")
    config = SpireConfig.from_json(meta["config"])
    tc, dc = target.config, config.model
    if (tc.vocab_size, tc.d_model) != (dc.vocab_size, dc.d_model):
        raise SpecstackError(f"draft {p.name} was trained for a target with vocabulary {dc.vocab_size} and width "
                             f"{dc.d_model}; {target.name} has {tc.vocab_size} and {tc.d_model}")
    state = load_file(str(p))
    model = SpireDraft(config, state["vocab_ids"])
    model.load_state_dict(state, strict=True)
    dtype = activation_dtype(fmt)
    model = model.to(dtype=dtype, device=target.model.device).eval()
    model.rope_cos, model.rope_sin = (t.to(target.model.device) for t in rope_tables(config.model))  # fp32
    model.attach_target(*shared_weights(target.model))
    for prm in model.parameters():
        prm.requires_grad_(False)
    if fmt in ("int8", "int4"):
        model.quantize_(fmt)
    return LoadedModel(f"spire:{p.stem}", model, None, config.model, fmt, source=str(p))


def draft_info(path: str | Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})



