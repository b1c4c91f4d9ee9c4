"""The batch-invariant quantized linear (`--dtype w8a8`): int8 weight codes per output channel, fp32
activations quantised to 8 bits **per row** at run time, products summed in integers.

Why per row: an integer dot product is exact whatever order it is summed in, and a row's activation
scale is its own max |x|, so a row's output never depends on which other rows share the forward. A
tree verified in one forward and the same tokens decoded one by one compute the same numbers, and
greedy speculation equals `ar` token for token in this format (in int4 and bf16 the kernel and its
blocking change with the row count, so they differ in the last bits).

y[r, n] = a_r * s_n * sum_k q_x[r, k] * q_w[n, k]   with a_r = max_k |x[r, k]| / 127, q_x = round(x / a_r),
s_n the weight's scale and q_w its code in [-63, 63]. Weights have 7 bits of range so the products of
u8 activations and s8 weights never saturate AVX2's vpmaddubsw (two u8 x s8 products summed into
int16: 255 * 63 * 2 < 2^15); the same codes on every CPU give the same numbers on every CPU.

Kernels, one chosen per process from what the CPU and torch offer (`KERNELS`, first that applies):
- fbgemm: torch's x86 int8 GEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`), given
  the row codes as integers with scale 1 and zero point 128: u8 x s8 products summed in int32, scaled
  by the weight's scale to fp32, then by each row's own. The weight is packed once per layer at first
  use (`prepack`).
- reference: the same arithmetic in float64 matmul (exact for these integer sums, which stay below
  2^53), for CPUs without fbgemm and for CUDA: slow, identical results.
"""
from __future__ import annotations

import warnings

import torch

from specstack.models import quantizers
from specstack.models.kernel_table import Kernel, KernelChoice, LinearKernels, choose

W_LEVELS = 63  # weight codes in [-63, 63]: see the docstring (saturation of vpmaddubsw)
X_LEVELS = 127  # activation codes in [-127, 127], stored by fbgemm as u8 with zero point 128
X_ZERO = 128
_TINY = 1e-30  # the scale of an all-zero row (its codes are all 0)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes int8 [N, K] in [-W_LEVELS, W_LEVELS], scales fp32 [N])."""
    codes, scale = quantizers.symmetric(w, None, W_LEVELS, _TINY)
    return codes.to(torch.int8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (codes [M, K] as exact integer floats in [-X_LEVELS, X_LEVELS], the row scales
    [M, 1]): codes = round(x / scale), scale = max |x| of the row / X_LEVELS. Five small kernels, in
    place where they can be: they are most of what this format adds to a step of a small model."""
    row = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=_TINY).mul_(1.0 / X_LEVELS)
    return torch.div(x, row).round_(), row


def reference(codes: torch.Tensor, scales: torch.Tensor) -> Kernel:
    """The per-row arithmetic in float64: exact integer sums, then fbgemm's scaling (acc * w_scale, then
    the row's scale), so both kernels give the same numbers."""
    w64 = codes.to(torch.float64).t().contiguous()
    s = scales.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        q, row = quantize_rows(x.float())
        return (q.to(torch.float64) @ w64).float().mul_(s).mul_(row)

    return run


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def fbgemm(codes: torch.Tensor, scales: torch.Tensor) -> Kernel:
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    packed: list[torch.ScriptObject] = []  # packed at first use: see `prepack`

    def pack() -> torch.ScriptObject:
        if not packed:
            packed.append(prepack(codes, scales))
        return packed[0]

    def run(x: torch.Tensor) -> torch.Tensor:
        q, row = quantize_rows(x)
        # the codes go in as exact integers with scale 1, so fbgemm's own rounding never decides one
        # (given fractional values, its rounding parts from torch.round's near halves: measured)
        return op(q, 1.0, X_ZERO, pack()).mul_(row)

    return run


def prepack(codes: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed layout of a layer's codes (opaque, machine-specific: made in each process)."""
    n = codes.shape[0]
    with warnings.catch_warnings():  # torch 2.13 calls quantized tensors deprecated; fbgemm's packing takes one
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(codes, scales.double(), torch.zeros(n, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(q, None)


KERNELS: tuple[LinearKernels, ...] = (
    KernelChoice("fbgemm", lambda dev: dev.type == "cpu" and _fbgemm_available(), fbgemm),
    KernelChoice("reference", lambda dev: True, reference),
)
FORCE_ENV = "SPECSTACK_W8A8_KERNEL"  # a kernel's name: use it (tests simulate a CPU without fbgemm)


def kernel_for(device: torch.device) -> LinearKernels:
    """The kernel this process uses on `device`: the forced one, else the first that applies."""
    return choose(KERNELS, FORCE_ENV, device)
