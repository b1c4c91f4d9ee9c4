"""The decoder's blocks in one native call a forward (models/kernels/layer.cpp), for the batch-invariant
w4a8 formats on a C++ kernel path with the fixed-order attention: the same operations as the eager
blocks (transformer.Block.forward), bit for bit, without a Python call per operation.

A table of two, as the kernels are (`DECODERS`; `SPECSTACK_DECODER` forces one): `native` where the
model qualifies (`unfit` says why not), `eager` everywhere. Both layouts of a batch run natively: a [B, T]
block's attention is one call, a packed block's (AttentionBatch.runs: a ragged batch's SPLIT layout, a
batched draft's appended levels) one call a run, as attention.attend makes them.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specstack.attention import AttentionBatch, RowRun
from specstack.cache import KVCache
from specstack.errors import SpecstackError
from specstack.models import native
from specstack.models.group_methods import GroupMethod
from specstack.models.quant import QLinear
from specstack.weight_formats import weight_format

DECODERS = ("native", "eager")
FORCE_ENV = "SPECSTACK_DECODER"
_EMPTY = torch.empty(0)


def unfit(model: Any) -> str | None:
    """Why `model` (a transformer.Transformer) cannot run natively here; None when it can."""
    if model.device.type != "cpu":
        return f"the model is on {model.device.type}"
    if not weight_format(model.fmt).batch_invariant or model.act_dtype != torch.float32:
        return f"{model.fmt} is not a batch-invariant format with fp32 activations"
    invariant = model.invariant_attention()
    if invariant is None or invariant.name != "fixed":
        return "the fixed-order attention kernel is not in use"
    for blk in model.blocks():
        for lin in (blk.qkv, blk.o, blk.up, blk.down):
            if not isinstance(lin.method, GroupMethod) or lin.method.op(lin)[0] is None:
                return f"layer {blk.layer} has a {lin.fmt} linear that has no w4a8 kernel op here"
    if not native.load("layer"):
        return "the layer library did not build"
    return None


def _linear(lin: QLinear) -> tuple[str, list[torch.Tensor], torch.Tensor]:
    assert isinstance(lin.method, GroupMethod)
    op, tensors = lin.method.op(lin)
    assert op is not None
    return op, tensors, _or_empty(lin.bias)


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t


class NativeDecoder:
    """A model's blocks as one native Decoder (layer.cpp); it holds the blocks' tensors themselves, so it
    is rebuilt whenever they may be replaced (Transformer drops it then). `decoder` and `rename`: another
    build's empty Decoder and the names of its ops, to compare builds (benchmarks/kernels_vs_rev.py)."""

    def __init__(self, model: Any, decoder: Any = None, rename: Callable[[str], str] = str) -> None:
        cfg = model.config
        self.n_layers = cfg.n_layers
        self.decoder = decoder if decoder is not None else torch.classes.specstack_layer.Decoder()
        f = cfg.block
        dims = [cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim, int(f.norm == "rms"), int(f.gated)]
        for blk in model.blocks():
            ops, tensors, counts, biases = [], [], [], []
            for lin in (blk.qkv, blk.o, blk.up, blk.down):
                op, ts, bias = _linear(lin)
                ops.append(rename(op))
                tensors += ts
                counts.append(len(ts))
                biases.append(bias)
            norms = [blk.attn_norm.weight, _or_empty(blk.attn_norm.bias), blk.mlp_norm.weight,
                     _or_empty(blk.mlp_norm.bias), _or_empty(blk.q_norm and blk.q_norm.weight),
                     _or_empty(blk.k_norm and blk.k_norm.weight)]
            self.decoder.add_layer(dims, cfg.norm_eps, ops, tensors, counts, biases, norms)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, batch: AttentionBatch,
                cache: KVCache, hidden_layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [B*T, d] (a packed block: [N, d]) through every block; the outputs of blocks `hidden_layers`
        (1-based) beside it."""
        b, t = batch.positions.shape
        w = cache.write_slots()
        wanted = sorted(i for i in set(hidden_layers) if 1 <= i <= self.n_layers)
        cos, sin = rope if rope is not None else (None, None)
        dims, tensors = _runs(batch.runs or ())
        x, hidden = self.decoder.forward(x, cos, sin, w.k, w.v, w.write_idx, w.rows, w.slots, w.one_row, b, t,
                                         w.s_used, cache.batch_size, batch.mask, batch.is_causal, dims, tensors,
                                         wanted)
        return x, dict(zip(wanted, hidden, strict=True))


def _runs(runs: Sequence[RowRun]) -> tuple[list[int], list[torch.Tensor]]:
    """A packed block's runs as Decoder.forward takes them: 6 numbers and 3 tensors (empty: none) a run."""
    dims: list[int] = []
    tensors: list[torch.Tensor] = []
    for r in runs:
        dims += [r.start, r.stop, r.tokens, r.first, r.keys, int(r.is_causal)]
        tensors += [_or_empty(r.mask), _or_empty(r.gather), _or_empty(r.real)]
    return dims, tensors


def forced_decoder() -> str | None:
    """The decoder SPECSTACK_DECODER names (None: not set); SpecstackError for a name not in DECODERS."""
    forced = os.environ.get(FORCE_ENV) or None
    if forced is not None and forced not in DECODERS:
        raise SpecstackError(f"{FORCE_ENV}={forced!r}: choose from {', '.join(DECODERS)}")
    return forced


def native_decoder(model: Any) -> NativeDecoder | None:
    """The native decoder of `model`, or None where it runs eagerly (forced by SPECSTACK_DECODER=eager, or
    unfit); a forced `native` the model cannot run is refused with the reason."""
    forced = forced_decoder()
    if forced == "eager":
        return None
    reason = unfit(model)
    if reason is not None:
        if forced == "native":
            raise SpecstackError(f"{FORCE_ENV}=native: {reason}")
        return None
    return NativeDecoder(model)
