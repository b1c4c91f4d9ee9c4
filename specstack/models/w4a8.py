"""The batch-invariant 4-bit format (`--dtype w4a8`): the GGUF's own 4-bit weight codes, fp32
activations rounded to 8 bits per row and per group of 32 inputs at run time, integer dot products per
group. It is the arithmetic llama.cpp itself uses for Q4 weights (a Q8 copy of the activations), so it
stays as close to the file as `int4` does, where `w8a8` re-derives 7-bit codes per output channel.

Terms: a *group* is 32 consecutive inputs. The weight of output n on input k is w = d[n, g] c[n, k] +
m[n, g] with the code c in 0..15 (GGUF Q4_0, Q4_1 and Q4_K blocks take this form exactly:
models/gguf_quants.py). A row x of activations is rounded per group: amax = max |x| over the group,
q = round(x * (127 / amax)) in [-127, 127], dx = amax / 127, sx = dx * sum(q). Then

    y[r, n] = sum_g (d[n, g] dx[r, g]) * sum_{k in g} c[n, k] q[r, k]  +  m[n, g] sx[r, g]

The layers a GGUF keeps in more than 4 bits (Q6_K, Q8_0, ...) and the unembedding take *8-bit
groups* instead (the layer format `q8a8`): w = d[n, g] c[n, k] with c in -127..127, no m (GGUF
Q8_0's layout, re-derived from the file's weights), times the same activation groups. Without them
(those layers in `w8a8`'s per-row arithmetic) the model sits far further from the file's fp32
numbers (docs/BENCHMARKS.md, the w4a8 section's "Distance from the GGUF").

Why it is batch-invariant: a row's codes, scales and sums are its own, and the kernel visits a row's
groups in one fixed order whatever other rows share the call, so a token's numbers never depend on
the tokens beside it: a verified tree computes what one-token steps compute, and greedy speculation
equals `ar` token for token in this format (as in `w8a8`, and as `int4`/`bf16` cannot).

Kernels (`KERNELS`, the first that applies, chosen once per process):
- avx2: C++ (models/kernels/w4a8.cpp), built once per machine (models/native.py): each 4-bit group is
  read and unpacked once for all the rows of a call, the activations are rounded in the same call (one
  op a linear, where `w8a8` runs five small kernels before fbgemm's and one after).
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
C_LEVELS = 15  # 4-bit codes 0..15
C8_LEVELS = 127  # 8-bit codes -127..127 (never -128: the kernel takes |c|)


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


def quantize_weight8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes int8 [N, K] in [-127, 127], d [N, K / 32]) with w ~ d c:
    each group's largest magnitude at 127 steps (GGUF Q8_0)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    d = (g.abs().amax(dim=2) / C8_LEVELS).clamp(min=1e-30)
    c = (g / d[..., None]).round().clamp(-C8_LEVELS, C8_LEVELS)
    return c.view(n, k).to(torch.int8), d


def codes_of(stored: torch.Tensor) -> torch.Tensor:
    """A layer's stored codes as codes [N, K]: 8-bit ones as they are, 4-bit ones unpacked."""
    return stored if stored.dtype == torch.int8 else unpack_codes(stored)


def dequantize(stored: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float weight [N, K] the codes stand for (m None: 8-bit groups)."""
    c = codes_of(stored).float()
    n, k = c.shape
    w = c.view(n, k // GROUP, GROUP) * d[..., None]
    return (w if m is None else w + m[..., None]).view(n, k)


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


def reference(stored: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Kernel:
    n = stored.shape[0]
    c64 = codes_of(stored).to(torch.float64).view(n, -1, GROUP)
    d32 = d.float()
    m64 = None if m is None else m.double()

    def row(x: torch.Tensor) -> torch.Tensor:  # x [1, K]
        q, dx, sx = quantize_groups(x)
        isum = torch.einsum("gk,ngk->ng", q.view(-1, GROUP).double(), c64)  # exact integers
        y = (d32 * dx).double() * isum
        return (y if m64 is None else y + m64 * sx.double()).sum(dim=1).float()

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[0] == 0:
            return x.new_empty(0, n)
        return torch.stack([row(x[r : r + 1]) for r in range(x.shape[0])])

    return run


def vnni512(stored: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Kernel:
    if m is None:
        op8 = torch.ops.specstack_w4a8.mm8_vnni.default
        return lambda x: op8(x.contiguous(), stored, d)
    op4 = torch.ops.specstack_w4a8.mm4_vnni.default
    return lambda x: op4(x.contiguous(), stored, d, m)


def avx2(stored: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Kernel:
    if m is None:
        op8 = torch.ops.specstack_w4a8.mm8.default
        return lambda x: op8(x.contiguous(), stored, d)
    op4 = torch.ops.specstack_w4a8.mm4.default
    return lambda x: op4(x.contiguous(), stored, d, m)


KERNELS: tuple[KernelChoice, ...] = (
    KernelChoice("vnni512", lambda dev: dev.type == "cpu" and native.has_vnni512() and native.load("w4a8"), vnni512),
    KernelChoice("avx2", lambda dev: dev.type == "cpu" and native.load("w4a8"), avx2),
    KernelChoice("reference", lambda dev: True, reference),
)
FORCE_ENV = "SPECSTACK_W4A8_KERNEL"  # a kernel's name: use it (tests run each path this CPU has)


def kernel_for(device: torch.device) -> KernelChoice:
    """The kernel this process uses on `device`: the forced one, else the first that applies."""
    return choose(KERNELS, FORCE_ENV, device)
