"""The batch-invariant 4-bit format (`--dtype w4a8`): the GGUF's own 4-bit weight codes, fp32
activations rounded to 8 bits per row and per group of 32 inputs at run time, integer dot products per
group. It is the arithmetic llama.cpp itself uses for Q4 weights (a Q8 copy of the activations), so it
stays as close to the file as `int4` does, where `w8a8` re-derives 7-bit codes per output channel.

Terms: a *group* is 32 consecutive inputs. The weight of output n on input k is w = d[n, g] c[n, k] +
m[n, g] with the code c in 0..15 (GGUF Q4_0, Q4_1 and Q4_K blocks take this form exactly:
models/gguf_quants.py). A row x of activations is rounded per group: amax = max |x| over the group,
q = round(x * (127 / amax)) in [-127, 127], dx = amax / 127, sx = dx * sum(q). Then

    y[r, n] = sum_g (d[n, g] dx[r, g]) * sum_{k in g} c[n, k] q[r, k]  +  m[n, g] sx[r, g]

Why it is batch-invariant: a row's codes, scales and sums are its own, and the kernel visits a row's
groups in one fixed order whatever other rows share the call, so a token's numbers never depend on
the tokens beside it: a verified tree computes what one-token steps compute, and greedy speculation
equals `ar` token for token in this format (as in `w8a8`, and as `int4`/`bf16` cannot).

Kernels (`KERNELS`, the first that applies, chosen once per process):
- avx2: C++ (models/kernels/w4a8.cpp), built once per machine (models/native.py): each 4-bit group is
  read and unpacked once for all the rows of a call, the activations are rounded in the same call (one
  op a linear, where `w8a8` runs five small kernels around fbgemm's).
- reference: torch, one row at a time (so no row can depend on another), the group sums exact in
  float64; on CPUs without AVX2 and on CUDA. It agrees with avx2 up to the fp32 rounding of avx2's sums
  (avx2 accumulates in fp32 lanes), so a model's numbers are those of the kernel its process chose.
"""
from __future__ import annotations

import torch

from specstack.models import native
from specstack.models.kernel_table import Kernel, KernelChoice, choose

GROUP = 32
X_LEVELS = 127
C_LEVELS = 15  # codes 0..15


def pack_codes(c: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N, K / 2] uint8: in each group, byte j holds code j (low nibble) and
    code j + 16 (high nibble), the order the kernel unpacks them in."""
    n, k = c.shape
    v = c.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: [N, K / 2] uint8 -> codes [N, K] uint8."""
    n, half = packed.shape
    v = packed.view(n, half // (GROUP // 2), GROUP // 2)
    return torch.cat([v & 0x0F, v >> 4], dim=2).reshape(n, 2 * half)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes uint8 [N, K], d [N, K / 32], m [N, K / 32]) with w ~ d c + m:
    each group's range split into 15 steps from its minimum."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d = ((hi - lo) / C_LEVELS).clamp(min=1e-30)
    c = ((g - lo[..., None]) / d[..., None]).round().clamp(0, C_LEVELS)
    return c.view(n, k).to(torch.uint8), d, lo


def dequantize(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float weight [N, K] the codes stand for."""
    c = unpack_codes(packed).float()
    n, k = c.shape
    return (c.view(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).view(n, k)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K] as exact integer floats, dx [M, K / 32], sx [M, K / 32]), the same
    fp32 operations as the C++ kernel's, so both round every value alike."""
    m, k = x.shape
    g = x.view(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=2)
    # a true division (a Python number over a tensor is a reciprocal times the number in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, X_LEVELS).div_(amax), torch.zeros_like(amax))
    q = (g * inv[..., None]).round_().clamp_(-X_LEVELS, X_LEVELS)
    dx = amax / X_LEVELS
    return q.view(m, k), dx, dx * q.sum(dim=2)


def reference(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Kernel:
    n = packed.shape[0]
    c64 = unpack_codes(packed).to(torch.float64).view(n, -1, GROUP)
    d32, m64 = d.float(), m.double()

    def row(x: torch.Tensor) -> torch.Tensor:  # x [1, K]
        q, dx, sx = quantize_groups(x)
        isum = torch.einsum("gk,ngk->ng", q.view(-1, GROUP).double(), c64)  # exact integers
        return ((d32 * dx).double() * isum + m64 * sx.double()).sum(dim=1).float()

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[0] == 0:
            return x.new_empty(0, n)
        return torch.stack([row(x[r : r + 1]) for r in range(x.shape[0])])

    return run


def avx2(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Kernel:
    op = torch.ops.specstack_w4a8.mm.default
    return lambda x: op(x.contiguous(), packed, d, m)


KERNELS: tuple[KernelChoice, ...] = (
    KernelChoice("avx2", lambda dev: dev.type == "cpu" and native.load("w4a8"), avx2),
    KernelChoice("reference", lambda dev: True, reference),
)
FORCE_ENV = "SPECSTACK_W4A8_KERNEL"  # a kernel's name: use it (tests simulate a CPU without AVX2)


def kernel_for(device: torch.device) -> KernelChoice:
    """The kernel this process uses on `device`: the forced one, else the first that applies."""
    return choose(KERNELS, FORCE_ENV, device)
