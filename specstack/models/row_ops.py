"""A block's row operations (RMSNorm, the rotation, the SiLU-gated product) as a table of two: torch's
composites (`TORCH`, every model's, and training's), and one native loop each (`NATIVE`,
models/kernels/layer.cpp) that the batch-invariant formats compute with where their attention is our
fixed-order kernel (models/fixed_attention.py hands it to the model with that attention). The native
decoder runs the same loops inside its one call, so a model's eager blocks and it compute the same
numbers; each row is computed on its own in one fixed order, so a row's numbers never depend on the rows
beside it or on the threads."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specstack.models import native


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dimension, through LayerNorm's fused kernel: [x, -x]
    has mean 0 and variance mean(x^2), so its first half normalised is the RMSNorm (on CPU F.rms_norm is
    a composite of ~8 kernels; this is 4)."""
    d = x.shape[-1]
    return F.layer_norm(torch.cat([x, x.neg()], dim=-1), (2 * d,), None, None, eps)[..., :d] * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim (head_dim) of x: rotate_half(x) * sin == roll(x, half) * [-sin | sin], two
    kernels instead of four."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> silu(gate) * up over the last dimension."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class RowOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    apply_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x [B, T, H, D], cos/sin [B, T, 1, D]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH = RowOps("torch", rms_norm, apply_rope, silu_mul)
# float32 on the CPU, no gradients: RMSNorm's sum of squares 8 lanes in column order then the lanes in
# one order; the rotation the composite's numbers bit for bit; SiLU through the attention's vectorised exp
NATIVE = RowOps("native", lambda x, w, eps: torch.ops.specstack_layer.rms_norm(x, w, eps),
                lambda x, cos, sin: torch.ops.specstack_layer.rope(x, cos, sin),
                lambda h: torch.ops.specstack_layer.silu_mul(h))


def fixed_order_rows() -> RowOps:
    """The row operations of a model whose attention is the fixed-order kernel: the native ones where the
    layer library builds (the native decoder needs it too), else torch's."""
    return NATIVE if native.available("layer") else TORCH
