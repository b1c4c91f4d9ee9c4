"""One decoder, its blocks assembled from the config's BlockFeatures (norm, activation, biases, q/k
norm, positions: Llama, Qwen2, Qwen3 and GPT-2 blocks alike; models/architectures.py). QKV and
gate/up projections are fused at load time, so a layer is four matrix products. Everything a forward needs beyond the tokens comes in an AttentionBatch
(positions and the mask from attention.py); keys/values go to the cache's scratch slots and stay
invisible until the caller commits them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from specstack.attention import AttentionBatch, AttentionFn, attend
from specstack.cache import KVCache, cache_slots
from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError
from specstack.models.base import Extends, ModelOutput
from specstack.models.bound import BoundModule, Forward
from specstack.models.coded import CodedWeight, concat
from specstack.models.fixed_attention import InvariantAttention, invariant_attention
from specstack.models.linear_methods import activation_dtype, native_bf16
from specstack.models.native_decoder import NativeDecoder, native_decoder
from specstack.models.quant import QLinear
from specstack.models.row_ops import TORCH, RowOps
from specstack.weight_formats import head_format, weight_format

Weight = torch.Tensor | CodedWeight
# the linear layers of a block, by name (a model's per-layer formats are keyed "layers.{i}.{name}")
LINEARS = ("qkv", "o", "up", "down")


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and [-sin | sin] per position [max_seq_len, head_dim] (fp32) for `apply_rope`."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    half = cfg.head_dim // 2
    return emb.cos(), torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1)


def register_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """`rope_tables` as the module's buffers `rope_cos`, `rope_signed_sin` (never stored: the config
    gives them)."""
    cos, signed_sin = rope_tables(cfg)
    module.register_buffer("rope_cos", cos, persistent=False)
    module.register_buffer("rope_signed_sin", signed_sin, persistent=False)


M = TypeVar("M", bound=nn.Module)


def blocks_of(layers: nn.ModuleList, kind: type[M]) -> list[M]:
    """A model's blocks, typed (iterating the ModuleList `layers` gives plain Modules)."""
    out = []
    for blk in layers:
        assert isinstance(blk, kind), f"layers holds only {kind.__name__}s"
        out.append(blk)
    return out


class Norm(BoundModule):
    """RMSNorm or LayerNorm with a bias (bound: see models/bound.py). trainable: its tensors take
    gradients (the SPIRe draft's blocks); the closure holds the parameters themselves, so an optimiser's
    in-place steps reach it."""

    def __init__(self, dim: int, eps: float, rms: bool, dtype: torch.dtype, trainable: bool = False) -> None:
        super().__init__()
        self.eps, self.rms = eps, rms
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=trainable)
        self.bias = None if rms else nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=trainable)

    rows: RowOps = TORCH  # whose RMSNorm (use_rows)

    def use_rows(self, rows: RowOps) -> None:
        self.rows = rows
        self.unbind()

    def bind(self) -> Forward:
        w, b, eps = self.weight, self.bias, self.eps
        d = w.shape[0]
        if not self.rms:
            return lambda x: F.layer_norm(x, (d,), w, b, eps)
        rms = self.rows.rms_norm
        return lambda x: rms(x, w, eps)


class Projection(Protocol):
    """A block's linear layer as its forward sees it: QLinear (a model's, any weight format) or
    nn.Linear (the SPIRe draft's blocks in training)."""

    def forward(self, x: torch.Tensor, /) -> torch.Tensor: ...


L = TypeVar("L", bound=Projection)
L_co = TypeVar("L_co", bound=Projection, covariant=True)


class BlockParts(Protocol[L_co]):
    """Where a block's parts come from: its linear layers by name ("layers.{i}.qkv", ...) and its norms."""

    def linear(self, name: str, n_in: int, n_out: int, bias: bool) -> L_co: ...

    def norm(self, dim: int, eps: float, rms: bool) -> Norm: ...


@dataclass(frozen=True)
class FormatParts:
    """A model's block parts: QLinear layers in its weight format (those named in `formats` in theirs:
    a GGUF type the int4 kernels cannot take exactly gets int8), norms in the format's activation dtype."""

    fmt: str
    formats: Mapping[str, str]

    def linear(self, name: str, n_in: int, n_out: int, bias: bool) -> QLinear:
        return QLinear(n_in, n_out, self.formats.get(name, self.fmt), bias, activation=activation_dtype(self.fmt))

    def norm(self, dim: int, eps: float, rms: bool) -> Norm:
        return Norm(dim, eps, rms, activation_dtype(self.fmt))


class BlockCache(Protocol):
    """What a block writes its new keys/values to and reads the keys/values its queries see from: a
    KVCache (models' forwards), or the SPIRe draft's training keys (models/spire_draft.py)."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Block(nn.Module, Generic[L]):
    """One decoder block, the only one: a model's (Block[QLinear], FormatParts) and the SPIRe draft's
    (spire_draft.DraftBlock: trainable parts, and what SPIRe adds)."""

    attn_norm: Norm
    mlp_norm: Norm
    qkv: L
    o: L
    up: L
    down: L

    def __init__(self, cfg: ModelConfig, layer: int, parts: BlockParts[L]) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        f = cfg.block
        rms = f.norm == "rms"

        def linear(name: str, n_in: int, n_out: int, bias: bool) -> L:
            return parts.linear(f"layers.{layer}.{name}", n_in, n_out, bias)

        self.attn_norm = parts.norm(cfg.d_model, cfg.norm_eps, rms)
        self.qkv = linear("qkv", cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, f.qkv_bias)
        self.o = linear("o", cfg.q_dim, cfg.d_model, f.o_bias)
        self.mlp_norm = parts.norm(cfg.d_model, cfg.norm_eps, rms)
        self.up = linear("up", cfg.d_model, (2 if f.gated else 1) * cfg.d_ff, f.mlp_bias)  # gated: [gate | up]
        self.down = linear("down", cfg.d_ff, cfg.d_model, f.mlp_bias)
        # q/k norm: one RMSNorm over each head of q and one over each head of k, before the rotation
        self.q_norm = parts.norm(cfg.head_dim, cfg.norm_eps, True) if f.qk_norm else None
        self.k_norm = parts.norm(cfg.head_dim, cfg.norm_eps, True) if f.qk_norm else None
        self.gated = f.gated
        # the model's own attention call (models/fixed_attention.py), set by Transformer; None: torch's
        self.attention: AttentionFn | None = None
        self.rows = TORCH  # its row operations (models/row_ops.py), set with the attention (use_rows)
        self.gather_parts()

    def use_rows(self, rows: RowOps) -> None:
        """Compute the block's row operations (and its norms') with `rows`."""
        self.rows = rows
        for norm in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm):
            if norm is not None:
                norm.use_rows(rows)

    def gather_parts(self) -> None:
        """Plain references to the submodules (nn.Module.__getattr__ costs microseconds a lookup, every
        layer of every step); gathered again only by a subclass that replaces its layers (the SPIRe
        draft's, quantised for inference)."""
        self.parts = (self.attn_norm, self.qkv, self.o, self.mlp_norm, self.up, self.down)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: AttentionBatch, cache: BlockCache) -> torch.Tensor:
        """x: [B*T, d] (kept 2-D between attention calls: fewer reshapes per layer; a packed block:
        [N, d], positions [1, N])."""
        cfg = self.cfg
        attn_norm, qkv_proj, o_proj, mlp_norm, up_proj, down_proj = self.parts
        b, t = batch.positions.shape
        # submodules are called through .forward: nn.Module.__call__'s hook checks cost microseconds a
        # call, hundreds of calls a decode step (no hooks are ever set on these)
        qkv = qkv_proj.forward(attn_norm.forward(x))
        hd, nq, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        qk = qkv[:, : cfg.q_dim + cfg.kv_dim].view(b, t, nq + nkv, hd)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            qk = torch.cat([q_norm.forward(qk[:, :, :nq]), k_norm.forward(qk[:, :, nq:])], dim=2)
        if rope is not None:  # rotate q and k heads in one go
            qk = self.rows.apply_rope(qk, *rope)
        k = qk[:, :, nq:].transpose(1, 2)
        v = qkv[:, cfg.q_dim + cfg.kv_dim :].view(b, t, nkv, hd).transpose(1, 2)
        keys, values = cache.write(self.layer, k, v)
        x = x + o_proj.forward(attend(qk[:, :, :nq], keys, values, batch, self.attention))
        h = up_proj.forward(mlp_norm.forward(x))
        if self.gated:
            h = self.rows.silu_mul(h)
        else:
            h = F.gelu(h, approximate="tanh")
        return x + down_proj.forward(h)


class Transformer(Extends, nn.Module):
    """The target, and a draft of the target's kind (a DecoderModel: models/base.py)."""

    rope_cos: torch.Tensor  # [max_seq_len, head_dim] buffers of rotary models (register_buffer)
    rope_signed_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, fmt: str = "fp32", formats: Mapping[str, str] | None = None) -> None:
        """formats: the layers whose format differs from `fmt` ("layers.{i}.qkv", ..., "head"): a GGUF
        type the int4 kernels cannot take exactly gets int8 there (models/gguf_quants.py)."""
        super().__init__()
        self.config, self.fmt = cfg, fmt
        self.formats = dict(formats or {})
        act = activation_dtype(fmt)
        self.act_dtype = act
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.d_model, dtype=act), requires_grad=False)
        self.pos_embed = (
            nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.d_model, dtype=act), requires_grad=False)
            if cfg.block.position == "learned" else None
        )
        parts = FormatParts(fmt, self.formats)
        self.layers = nn.ModuleList(Block(cfg, i, parts) for i in range(cfg.n_layers))
        self.norm = Norm(cfg.d_model, cfg.norm_eps, cfg.block.norm == "rms", act)
        # int4 keeps the unembedding in int8 and w4a8 in w8a8, as GGUF files do (Q8_0 embeddings): a
        # 4-bit head costs visible logit fidelity. (fp32 activations would give fp32 logits, fewer bf16
        # ties, but the int8 kernel is several times slower with them: docs/bench-history, "Small costs
        # behind the code's choices".)
        head_fmt = self.formats.get("head", head_format(fmt))
        self.head = QLinear(cfg.d_model, cfg.vocab_size, head_fmt, activation=act)
        self.head_tokens: torch.Tensor | None = None  # with_head_over: the tokens the head scores
        self._invariant: InvariantAttention | None = None  # invariant_attention, once chosen
        # the blocks as one native call (models/native_decoder.py), chosen at the first forward; dropped
        # whenever the blocks' tensors may be replaced (it holds them)
        self._native: NativeDecoder | None = None
        self._native_chosen = False
        if cfg.block.position == "rope":
            register_rope(self, cfg)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def blocks(self) -> list[Block[QLinear]]:
        return blocks_of(self.layers, Block)

    # -- weights ------------------------------------------------------------------------------------
    def _drop_native(self) -> None:
        self._native, self._native_chosen = None, False

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        self._drop_native()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._drop_native()
        super()._load_from_state_dict(*args, **kwargs)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Weight]) -> Transformer:
        """Fill the model from canonical float (or Q4) weights; see loading.py for the names."""
        self._drop_native()
        cfg = self.config
        used: set[str] = set()

        def get(name: str) -> Weight:
            if name not in weights:
                raise KeyError(f"missing weight {name}")
            used.add(name)
            return weights[name]

        def dense(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            w = get(name)
            w = w if isinstance(w, torch.Tensor) else w.dequantize()
            if len(w.shape) != len(shape) or any(a != b for a, b in zip(w.shape, shape, strict=True) if b != -1):
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(w.shape)}")
            return w

        def linear(dst: QLinear, names: Sequence[str], bias_names: Sequence[str] | None) -> None:
            parts = [get(n) for n in names]
            rows = sum(p.shape[0] for p in parts)
            cols = {p.shape[1] for p in parts}
            if (rows, cols) != (dst.out_features, {dst.in_features}):
                raise ValueError(f"{names}: shapes do not fit a {dst.in_features}->{dst.out_features} layer")
            coded = None if any(isinstance(p, torch.Tensor) for p in parts) else \
                concat([p for p in parts if not isinstance(p, torch.Tensor)])
            if coded is not None:
                dst.set_codes(coded)
            else:
                dst.set_float(torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]))
            if bias_names:
                if dst.bias is None:
                    raise ValueError(f"{names}: the weights carry biases the layer was built without")
                dst.bias.copy_(torch.cat([dense(n, (-1,)) for n in bias_names]))

        self.embed.copy_(dense("embed", (cfg.vocab_size, cfg.d_model)))
        if self.pos_embed is not None:
            self.pos_embed.copy_(dense("pos_embed", (cfg.max_seq_len, cfg.d_model)))
        f = cfg.block

        def biases(prefix: str, on: bool, *names: str) -> list[str] | None:
            return [prefix + n + ".bias" for n in names] if on else None

        def norm(module: Norm, name: str, dim: int) -> None:
            module.weight.copy_(dense(name + ".weight", (dim,)))
            if module.bias is not None:
                module.bias.copy_(dense(name + ".bias", (dim,)))

        up_names = ("gate", "up") if f.gated else ("up",)
        for i, blk in enumerate(self.blocks()):
            p = f"layers.{i}."
            norm(blk.attn_norm, p + "attn_norm", cfg.d_model)
            norm(blk.mlp_norm, p + "mlp_norm", cfg.d_model)
            if blk.q_norm is not None and blk.k_norm is not None:
                norm(blk.q_norm, p + "q_norm", cfg.head_dim)
                norm(blk.k_norm, p + "k_norm", cfg.head_dim)
            linear(blk.qkv, [p + "q", p + "k", p + "v"], biases(p, f.qkv_bias, "q", "k", "v"))
            linear(blk.o, [p + "o"], biases(p, f.o_bias, "o"))
            linear(blk.up, [p + n for n in up_names], biases(p, f.mlp_bias, *up_names))
            linear(blk.down, [p + "down"], biases(p, f.mlp_bias, "down"))
        norm(self.norm, "norm", cfg.d_model)
        linear(self.head, ["head" if "head" in weights else "embed"], None)
        unused = set(weights) - used
        if unused:
            raise ValueError(f"unused weights: {sorted(unused)[:5]}")
        return self

    # -- use ----------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int = 1, capacity: int | None = None,
                  window: WindowSpec | None = None, max_rows: int | None = None,
                  max_capacity: int | None = None) -> KVCache:
        cap, most = cache_slots(self.config, capacity, max_capacity)
        return KVCache(self.config, batch_size, cap, self.kv_dtype, self.device, window, max_rows=max_rows,
                       max_capacity=most)

    @property
    def native_blocks(self) -> bool:
        """Whether the blocks run as one native call a forward (models/native_decoder.py; decided at the
        first forward)."""
        return self._native is not None

    def invariant_attention(self) -> InvariantAttention | None:
        """The batch-invariant formats' attention (models/fixed_attention.py: fixed-order sums over an fp32
        cache, or torch's over a float64 one), chosen once per model and handed to its blocks; None in
        the other formats."""
        if not weight_format(self.fmt).batch_invariant:
            return None
        if self._invariant is None:
            self._invariant = invariant_attention(self.device)
            for blk in self.blocks():
                blk.attention = self._invariant.run
                blk.use_rows(self._invariant.rows)
            self.norm.use_rows(self._invariant.rows)
        return self._invariant

    @property
    def kv_dtype(self) -> torch.dtype:
        """bf16 activations keep fp32 keys/values on a CPU without native bf16: attention over an
        emulated bf16 cache costs many times fp32 for one-token queries, and a step of one row is
        faster with it (docs/bench-history, "Batched decoding").
        The batch-invariant formats (w8a8, w4a8) keep what their attention needs (`invariant_attention`)."""
        invariant = self.invariant_attention()
        if invariant is not None:
            return invariant.kv_dtype
        if self.act_dtype == torch.bfloat16 and self.device.type == "cpu" and not native_bf16():
            return torch.float32
        return self.act_dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                hidden_layers: Sequence[int] = (), logit_rows: slice | torch.Tensor = slice(None)) -> ModelOutput:
        """tokens [B, T] ([1, N] packed) -> logits [B, T, V] (fp32). hidden_layers: 0 = embeddings, i =
        output of block i. logit_rows: the positions of the block whose logits are wanted (a prefill
        needs one or none: unembedding every prompt token costs many decode steps, docs/bench-history,
        "Wide forwards on dense weights"); a tensor of indices into the flattened B * T tokens gives
        logits [1, len, V]."""
        pos = batch.positions
        if self._invariant is None:
            self.invariant_attention()
        cache.begin_block(pos, batch.append, batch.counts)
        b, t = tokens.shape
        x = F.embedding(tokens.reshape(-1), self.embed)
        rope = None
        if self.pos_embed is not None:
            x = x + F.embedding(pos.reshape(-1), self.pos_embed)
        else:  # rotary
            rope = (self.rope_cos[pos].unsqueeze(2).to(x.dtype), self.rope_signed_sin[pos].unsqueeze(2).to(x.dtype))
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x.view(b, t, -1)
        if not self._native_chosen:
            self._native, self._native_chosen = native_decoder(self), True
        if self._native is not None:
            x, out = self._native.forward(x, rope, batch, cache, hidden_layers)
            hidden.update((i, h.view(b, t, -1)) for i, h in out.items())
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, rope, batch, cache)  # .forward: see Block.forward
                if i + 1 in hidden_layers:
                    hidden[i + 1] = x.view(b, t, -1)
        if isinstance(logit_rows, torch.Tensor):
            x, b = x.index_select(0, logit_rows), 1
        elif logit_rows != slice(None):
            x = x.view(b, t, -1)[:, logit_rows].reshape(-1, x.shape[-1])
        rows = x.shape[0] // b
        if rows == 0:
            return ModelOutput(x.new_empty(b, 0, self.config.vocab_size, dtype=torch.float32), hidden)
        logits = self.head.forward(self.norm.forward(x).to(self.head.act_dtype)).float()
        if self.head_tokens is not None:  # a head over some tokens (FR-Spec): the others get -inf
            full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.head_tokens, logits)
        return ModelOutput(logits.view(b, rows, -1), hidden)

    def first_layers(self, n: int) -> Transformer:
        """A model of this one's first `n` blocks with its embeddings, final norm and head (a self-draft:
        MagicDec-style, without training). Every tensor is shared with this model, none copied."""
        if not 1 <= n <= self.config.n_layers:
            raise SpecstackError(f"self-draft: {n} layers requested, the model has {self.config.n_layers}")
        with torch.device("meta"):  # the skeleton allocates nothing: every tensor in it is replaced below
            model = Transformer(replace(self.config, n_layers=n), self.fmt, self.formats)
        for name, part in (*self.named_parameters(recurse=False), *self.named_buffers(recurse=False),
                           *self.named_children()):
            setattr(model, name, part)
        model.layers = self.layers[:n]
        return model

    @torch.no_grad()
    def with_head_over(self, tokens: torch.Tensor) -> Transformer:
        """This model with its unembedding restricted to `tokens` (FR-Spec, Zhao et al. 2025: a draft's
        head over the most frequent tokens costs a fraction of the full vocabulary's); every other token
        gets logit -inf, so a draft never proposes it and its q there is 0. The logits keep the full
        vocabulary's shape, so drafters and verifiers see nothing new; the target still scores every
        token, so the output does not change. Every other tensor is shared, none copied."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).unique()
        if tokens.numel() == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise SpecstackError(f"a restricted head needs token ids in [0, {self.config.vocab_size})")
        model = self.first_layers(self.config.n_layers)
        model.head = self.head.take_rows(tokens)  # its own codes and scales: the same numbers for those tokens
        model.head_tokens = tokens
        return model
