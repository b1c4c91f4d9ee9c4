"""Attention for the batch-invariant formats (w8a8, w4a8 and its layer formats): a token's attention must
not depend on the tokens beside it, or a verified tree, a chain and a batch of rows would each compute
other numbers than one-token steps, and speculation would not equal `ar` in those formats.

torch's kernels block their sums by the shapes of the call (a matmul for one query, a flash kernel for
many), which moves the last bit of fp32. Two ways out, a table as the weight kernels are (the first
that applies, `SPECSTACK_INVARIANT_ATTENTION` forces one):
- fixed: our C++ kernel (models/kernels/attention.cpp) sums each query in one fixed order over the keys
  it may see (fp32 dot products of a fixed shape, the softmax and each output lane in slot order), so
  the keys and values stay in fp32; the blocks' row operations are ours too (models/row_ops.py), so the
  native decoder (models/native_decoder.py) can compute them in its one call;
- float64: torch's own attention over a float64 cache, where those blocking differences are ~1e-16 and
  vanish when the result is rounded to fp32 (twice the cache's memory, and slower matmuls); on CPUs
  without AVX2, where the kernel does not build, and on CUDA.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specstack.attention import AttentionFn
from specstack.models import native
from specstack.models.kernel_table import KernelChoice, choose
from specstack.models.row_ops import TORCH, RowOps, fixed_order_rows


@dataclass(frozen=True)
class InvariantAttention:
    name: str
    kv_dtype: torch.dtype  # what the cache holds
    run: AttentionFn | None  # None: attention.py's own (torch's kernels, in the cache's dtype)
    rows: RowOps  # the blocks' row operations (models/row_ops.py)


def _fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool) -> torch.Tensor:
    return torch.ops.specstack_attention.fixed.default(q, k, v, mask, is_causal)


KERNELS: tuple[KernelChoice[Callable[[], InvariantAttention]], ...] = (
    KernelChoice("fixed", lambda dev: dev.type == "cpu" and native.available("attention"),
                 lambda: InvariantAttention("fixed", torch.float32, _fixed, fixed_order_rows())),
    KernelChoice("float64", lambda dev: True, lambda: InvariantAttention("float64", torch.float64, None, TORCH)),
)
FORCE_ENV = "SPECSTACK_INVARIANT_ATTENTION"


def invariant_attention(device: torch.device) -> InvariantAttention:
    """The batch-invariant attention of this process on `device`: the forced one, else the first that applies."""
    return choose(KERNELS, FORCE_ENV, device).build()
