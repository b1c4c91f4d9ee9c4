"""What the throughput model needs to know about a decoder: its shape and how many bytes its values take.

A `ModelShape` comes from any model specstack can load (only its config is read, never its weights),
from a named shape of the SPIRe paper, or from a plain description such as
`layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=4096`. Counting rules:

- N (`body_params`): the matrices of the decoder blocks (q, k, v, o and the MLP); norms and biases are
  left out (they cost no matmul FLOPs and a negligible read). The published model counts only this N.
- `head_params`: the unembedding (vocab x d_model). Named shapes and descriptions without `vocab` leave
  it out, as the paper does; shapes of loadable models include it, because a small model on a real
  machine spends a large share of its pass there (SmolLM2-135M: 28 M of its 134 M matrix parameters).
- bytes per value follow the weight format (`fmt`): `fp8` is the published convention (every value one
  byte); the engine's formats are as stored (models/quant.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specstack.config import ModelConfig
from specstack.errors import SpecstackError
from specstack.models.configs import read_gguf_config, read_hf_config
from specstack.models.drafts import DraftKind, DraftSpec, choose_draft
from specstack.models.registry import resolve
from specstack.weight_formats import FORMATS as TABLE

# Bytes per weight of each format, as its layers store it (specstack/weight_formats.py); fp8 is the
# published convention (every value one byte).
WEIGHT_BYTES: dict[str, float] = {"fp8": 1.0, **{f.name: f.bytes_per_weight for f in TABLE.values()}}
FORMATS = tuple(WEIGHT_BYTES)
# Bytes per cached key/value element: the engine's activations (and cache) are bf16 except in fp32
# and the batch-invariant formats, whose cache is fp32 under their fixed-order attention
# (WeightFormat.kv_bytes).
KV_BYTES: dict[str, float] = {"fp8": 1.0, **{f.name: f.kv_bytes for f in TABLE.values()}}


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    d_model: int
    q_dim: int  # query heads x head_dim: the width of attention's FLOPs
    n_kv_heads: int
    head_dim: int
    body_params: int  # N
    head_params: int = 0
    window: int | None = None  # KV positions the model itself keeps (a sliding-window model); None: all
    fmt: str = "fp8"

    def __post_init__(self) -> None:
        ints = {"layers": self.n_layers, "d_model": self.d_model, "q_dim": self.q_dim,
                "kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "params": self.body_params}
        bad = [f"{k}={v}" for k, v in ints.items() if not (isinstance(v, int) and v > 0)]
        if bad:
            raise SpecstackError(f"model {self.name!r}: {', '.join(bad)}: must be positive integers")
        if self.head_params < 0:
            raise SpecstackError(f"model {self.name!r}: head params must be >= 0, got {self.head_params}")
        if self.window is not None and self.window < 1:
            raise SpecstackError(f"model {self.name!r}: window must be >= 1, got {self.window}")
        if self.fmt not in WEIGHT_BYTES:
            raise SpecstackError(f"unknown weight format {self.fmt!r}; choose from {', '.join(FORMATS)}")

    @property
    def params(self) -> int:
        """Matrix parameters a pass multiplies by: 2 FLOPs each per token."""
        return self.body_params + self.head_params

    @property
    def kv_values_per_token(self) -> int:
        """x = 2 · layers · kv_heads · head_dim: keys and values cached per token."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        head_fmt = (TABLE[self.fmt].head if self.fmt in TABLE else None) or self.fmt
        return self.body_params * WEIGHT_BYTES[self.fmt] + self.head_params * WEIGHT_BYTES[head_fmt]

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_values_per_token * KV_BYTES[self.fmt]

    def in_format(self, fmt: str) -> ModelShape:
        return replace(self, fmt=fmt)

    def first_layers(self, n: int, name: str | None = None) -> ModelShape:
        """The first n blocks with the same head: a self-draft (all blocks have the same size)."""
        if not 1 <= n <= self.n_layers:
            raise SpecstackError(f"{n} layers of {self.name!r} requested: it has {self.n_layers}")
        return replace(self, name=name or f"{self.name}[:{n}]", n_layers=n,
                       body_params=self.body_params * n // self.n_layers)


def block_params(d_model: int, q_dim: int, kv_dim: int, d_ff: int, gated: bool = True) -> int:
    """Matrix parameters of one block: q and o (d x q_dim), k and v (d x kv_dim), and the MLP
    (three d x d_ff matrices when gated like SwiGLU, two for GPT-2's)."""
    return 2 * d_model * q_dim + 2 * d_model * kv_dim + (3 if gated else 2) * d_model * d_ff


def shape(name: str, layers: int, d_model: int, kv_heads: int, head_dim: int, d_ff: int | None = None,
          heads: int | None = None, params: int | None = None, vocab: int = 0, gated: bool = True,
          window: int | None = None, fmt: str = "fp8") -> ModelShape:
    """A shape from its hyper-parameters; `params` (N) overrides the count from d_ff; heads default to
    kv_heads (multi-head attention)."""
    heads = heads or kv_heads
    if heads % kv_heads:
        raise SpecstackError(f"model {name!r}: heads={heads} is not a multiple of kv_heads={kv_heads}")
    if params is None:
        if d_ff is None:
            raise SpecstackError(f"model {name!r}: give d_ff (the MLP width) or params (N)")
        params = layers * block_params(d_model, heads * head_dim, kv_heads * head_dim, d_ff, gated)
    return ModelShape(name, layers, d_model, heads * head_dim, kv_heads, head_dim, params,
                      vocab * d_model, window, fmt)


# The SPIRe paper's target (8 blocks, N = 67.1 M) and its extrapolation, Llama-3-70B, as the paper
# counts them: body parameters only, one byte per value.
NAMED: dict[str, ModelShape] = {
    "spire-67m": shape("spire-67m", layers=8, d_model=512, kv_heads=8, head_dim=128, d_ff=4096),
    "llama-3-70b": shape("llama-3-70b", layers=80, d_model=8192, heads=64, kv_heads=8, head_dim=128,
                         d_ff=28672),
}

_KEYS = {"layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "params", "vocab", "window", "gated"}
_REQUIRED = ("layers", "d_model", "kv_heads", "head_dim")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}


def _count(key: str, text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmb]?)\s*", text.lower())
    if m is None:
        raise SpecstackError(f"model description: {key}={text!r} is not a count (e.g. 512, 67.1M, 1.2B)")
    value = float(m.group(1)) * _SUFFIX[m.group(2)]
    if value != int(value) and not m.group(2):
        raise SpecstackError(f"model description: {key}={text!r} must be an integer")
    return round(value)


def describe(text: str, name: str | None = None) -> ModelShape:
    """`layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=4096[,heads=H][,params=67.1M][,vocab=V]
    [,window=W][,gated=0]`."""
    values: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise SpecstackError(f"model description {text!r}: bad item {item!r} (keys: {', '.join(sorted(_KEYS))})")
        if key in values:
            raise SpecstackError(f"model description {text!r}: {key} given twice")
        values[key] = _count(key, value)
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise SpecstackError(f"model description {text!r}: missing {', '.join(missing)}")
    gated = bool(values.pop("gated", 1))
    return shape(name or text, gated=gated, **values)


def from_config(config: ModelConfig, name: str, fmt: str = "fp8") -> ModelShape:
    """A loaded (or configured) model, head included."""
    return shape(name, layers=config.n_layers, d_model=config.d_model, heads=config.n_heads,
                 kv_heads=config.n_kv_heads, head_dim=config.head_dim, d_ff=config.d_ff,
                 vocab=config.vocab_size, gated=config.block.gated, fmt=fmt)


def read_config(model: str) -> ModelConfig:
    """The config of a loadable model (registry name, .gguf file, checkpoint directory), without its weights."""
    src = resolve(model)
    return read_gguf_config(src.path) if src.kind == "gguf" else read_hf_config(src.path)


def looks_like_description(text: str) -> bool:
    return "=" in text


def is_loadable(spec: str) -> bool:
    """A model the engine can load (as opposed to a named shape or a description): only its config
    gives its shape, and only it can run (`--tau auto`)."""
    return spec not in NAMED and not looks_like_description(spec)


def default_draft_spec(target_spec: str, target: ModelShape) -> str:
    """The engine's draft for a loadable target (models/drafts.py), the fallback for a named shape or a
    description."""
    return str(choose_draft(None, target.n_layers, target_spec if is_loadable(target_spec) else None))


def model_shape(spec: str, fmt: str = "fp8") -> ModelShape:
    """A named shape, a plain description (has '='), or a loadable model's config."""
    spec = spec.strip()
    if not spec:
        raise SpecstackError("empty model")
    if spec in NAMED:
        return NAMED[spec].in_format(fmt)
    if looks_like_description(spec):
        return describe(spec).in_format(fmt)
    return from_config(read_config(spec), spec, fmt)


def draft_shape(spec: str, target: ModelShape, fmt: str) -> ModelShape:
    """`self:N` (the target's first N blocks and its head), a trained draft file (`default`: the one
    shipped for the target), `magicdec:W` (the target itself), or anything `model_shape` takes."""
    draft = DraftSpec.parse(spec).resolved(target.name)
    if draft.kind == DraftKind.FILE:
        return trained_draft_shape(draft.source, target)
    if draft.kind == DraftKind.MAGICDEC:
        return target
    if draft.kind == DraftKind.SELF:
        return target.first_layers(draft.size, name=spec).in_format(fmt)
    return model_shape(draft.source, fmt)


def trained_draft_shape(path: str, target: ModelShape) -> ModelShape:
    """A draft from `specstack train-draft`: its blocks have the target's widths; its head is its own
    vocabulary's rows; it computes in bf16 and keeps sink + window positions."""
    # deferred: models.draft_file imports torch, and this module stays torch-free for the command's cheap
    # checks (a named shape or a description reads no file)
    from specstack.models.draft_file import read_draft_header

    header = read_draft_header(path)
    cfg = header.config
    window = cfg.window.sink + cfg.window.window if cfg.window else None
    return replace(target.first_layers(cfg.model.n_layers, name=path), head_params=header.vocab * cfg.model.d_model,
                   window=window, fmt="bf16")
