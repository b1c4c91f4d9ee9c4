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
numbers (docs/bench-history, the w4a8 section's "Distance from the GGUF").

GGUF Q4_K layers take *super-blocks* (the layer format `k4a8`): the same 4-bit codes, with each
group's d and m kept as Q4_K keeps them, 6-bit multiples sc, mn of one (D, M) per 8 groups:
d = D sc, m = M mn. 3 bytes of scales a group instead of 8 (4.75 bits a weight instead of 6), and
the same numbers: D sc and M mn are exact in fp32, so the kernels expand them and go on as above.

GGUF Q6_K layers take *6-bit groups* (the layer format `k6a8`): Q6_K's codes c in 0..63 with
w = D s (c - 32), an int8 s per 16 weights and D per 256 (6.625 bits a weight where q8a8 holds 9). The
integer sums take the 16-weight scales in (sum_g = sum_16 s sum (c - 32) q, exact), so D dx is the
group's one float factor, as d dx is above.

GGUF Q5_0 layers take *5-bit groups* (the layer format `q5a8`): Q5_0's codes c in 0..31 with
w = d (c - 16), d per group (6 bits a weight with the fp32 d, 5.5 in the wide layout, which keeps a layer's
d in fp16 where they are exact in it, as the file's are; q8a8 holds 9): the integer sums are
sum (c - 16) q, so d dx is again the group's one float factor, and no min term.

Why it is batch-invariant: a row's codes, scales and sums are its own, and the kernel visits a row's
groups in one fixed order whatever other rows share the call, so a token's numbers never depend on
the tokens beside it: a verified tree computes what one-token steps compute, and greedy speculation
equals `ar` token for token in this format (as in `w8a8`, and as `int4`/`bf16` cannot).

Kernels (`KERNELS`, the first that applies, chosen once per process):
- amx: the wide layout on AMX-INT8 for calls of 32 rows or more (models/kernels/w4a8_amx.h: a tile
  product gives a group's integer sums for 16 rows and 16 outputs; the threshold is w4a8_wide.cpp's
  `amx_from`), wide512's tiles for fewer and for 6-bit groups; the same numbers as wide512 bit for bit
  (the same sums, the same float epilogue), so a process may take either for any call;
- wide512: AVX-512-VNNI on the *wide layout* (models/w4a8_wide.py): each layer repacked after load so
  that a vector's lanes are 16 outputs; a group's float work is one multiply-add for 16 outputs of a
  row and each weight is unpacked once for 8 rows, so a forward of several rows costs little more than
  one (a layer whose outputs are not whole blocks of 16 keeps its own layout and runs a padded wide
  copy: the same numbers output by output);
- vnni512: C++ for AVX-512-VNNI (same library, its own target): vpdpbusd on 64 codes at a time, a
  lane's sum in one group, so the float epilogue is one multiply-add a vector and one lane reduction
  an output (the kernel file says how the codes and activations are laid out for it).
- avx2: C++ (models/kernels/w4a8.cpp), built once per machine (models/native.py): each 4-bit group is
  read and unpacked once for all the rows of a call, the activations are rounded in the same call (one
  op a linear, where `w8a8` runs five small kernels before fbgemm's and one after).
- reference: torch, one row at a time (so no row can depend on another), the group sums exact in
  float64; on CPUs without AVX2 and on CUDA. It agrees with avx2 up to the fp32 rounding of avx2's sums
  (the native paths accumulate in fp32 lanes, each in its own order), so a model's numbers are those of
  the kernel its process chose.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from specstack.models import native, quantizers, w4a8_wide
from specstack.models.kernel_table import Kernel, KernelChoice, LinearKernels, choose
from specstack.models.w4a8_codes import (
    C8_LEVELS,
    C_LEVELS,
    GROUP,
    OPS,
    SIX_OFFSET,
    SIX_SUB,
    SUB_LEVELS,
    SUPER,
    X_LEVELS,
    unpack_codes,
    unpack_codes5,
    unpack_codes6,
)


def quantize_weight5(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes uint8 [N, K] in 1..31, d [N, K / 32]) with w ~ d (c - 16): each
    group's largest magnitude at 15 steps (GGUF Q5_0's form; its codes also reach 0)."""
    c, d = quantizers.symmetric(w, GROUP, 15, 1e-30)
    return (c + 16).to(torch.uint8), d


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes uint8 [N, K], d [N, K / 32], m [N, K / 32]) with w ~ d c + m:
    each group's range split into 15 steps from its minimum."""
    c, d, m = quantizers.minmax(w, GROUP, C_LEVELS, 1e-30)
    return c.to(torch.uint8), d, m


def quantize_weight8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (codes int8 [N, K] in [-127, 127], d [N, K / 32]) with w ~ d c:
    each group's largest magnitude at 127 steps (GGUF Q8_0)."""
    c, d = quantizers.symmetric(w, GROUP, C8_LEVELS, 1e-30)
    return c.to(torch.int8), d


def expand_scales(sup: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k4a8's super-blocks -> the per-group (d, m) [N, K / 32] they stand for: d = D sc, m = M mn, exact
    in fp32 (an fp16 times a 6-bit integer), as the kernels expand them."""
    n, supers, _ = sup.shape
    per = sub.shape[2] // supers
    big = sup.float().repeat_interleave(per, dim=1)  # [N, G, 2]
    return big[..., 0] * sub[:, 0].float(), big[..., 1] * sub[:, 1].float()


def quantize_weight_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (K a multiple of 256) -> k4a8's (codes uint8 [N, K], sup fp32 [N, K / 256, 2],
    sub uint8 [N, 2, K / 32]): each group's step and minimum as 6-bit multiples of its super-block's
    largest (GGUF Q4_K's form, w = D sc c + M mn with M <= 0), then the codes against them."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2)
    # rounded up, the minimum first and then the step from it: every group's range stays covered
    depth = (-lo).view(n, -1, SUPER)
    big_m = (depth.amax(dim=2) / SUB_LEVELS).clamp(min=1e-30)
    mn = (depth / big_m[..., None]).ceil().clamp(0, SUB_LEVELS)
    step = ((hi.view(n, -1, SUPER) + big_m[..., None] * mn) / C_LEVELS)
    big_d = (step.amax(dim=2) / SUB_LEVELS).clamp(min=1e-30)
    sc = (step / big_d[..., None]).ceil().clamp(1, SUB_LEVELS)
    sup = torch.stack([big_d, -big_m], dim=-1)
    sub = torch.stack([sc.view(n, -1), mn.view(n, -1)], dim=1).to(torch.uint8)
    d, m = expand_scales(sup, sub)
    c = ((g - m[..., None]) / d[..., None]).round().clamp(0, C_LEVELS)
    return c.view(n, k).to(torch.uint8), sup, sub


def quantize_weight6(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (K a multiple of 256) -> k6a8's (codes uint8 [N, K] in 0..63, D fp32 [N, K / 256],
    s int8 [N, K / 16]) with w ~ D s (c - 32): each 16 weights' step (its largest magnitude over 31) as a
    multiple of its super-block's largest step / 127, rounded up so the codes stay in range."""
    n, k = w.shape
    sub = w.float().view(n, k // SIX_SUB, SIX_SUB)
    step = sub.abs().amax(dim=2) / (SIX_OFFSET - 1)
    big = (step.view(n, -1, GROUP * SUPER // SIX_SUB).amax(dim=2) / C8_LEVELS).clamp(min=1e-30)
    s = (step / big.repeat_interleave(GROUP * SUPER // SIX_SUB, 1)).ceil().clamp(1, C8_LEVELS)
    unit = (big.repeat_interleave(GROUP * SUPER // SIX_SUB, 1) * s)[..., None]
    c = (sub / unit).round().clamp(-SIX_OFFSET, SIX_OFFSET - 1) + SIX_OFFSET
    return c.view(n, k).to(torch.uint8), big, s.to(torch.int8)


GroupForm = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _six(stored: torch.Tensor, big: torch.Tensor, s16: torch.Tensor | None) -> GroupForm:
    assert s16 is not None, "k6a8 has sub-block scales"
    c = (unpack_codes6(stored).to(torch.int32) - SIX_OFFSET) * s16.to(torch.int32).repeat_interleave(SIX_SUB, 1)
    return c, big.repeat_interleave(SUPER, 1), None


def _k4(stored: torch.Tensor, sup: torch.Tensor, sub: torch.Tensor | None) -> GroupForm:
    assert sub is not None, "k4a8 has sub-block scales"
    return (unpack_codes(stored), *expand_scales(sup, sub))


# Each layer format's tensors (stored codes, scales, mins or sub-block scales) -> the per-group form of
# the module docstring: integer codes [N, K] (k6a8's times their 16-weight scales: s (c - 32)), d and m
# [N, K / 32] (m None: no mins), with w = d c + m. The reference computes from it; so do float weights.
GROUP_FORMS: Mapping[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], GroupForm]] = {
    "w4a8": lambda stored, d, m: (unpack_codes(stored), d, m),
    "q8a8": lambda stored, d, _: (stored, d, None),
    "k4a8": _k4,
    "k6a8": _six,
    "q5a8": lambda stored, d, _: (unpack_codes5(stored).to(torch.int32) - 16, d, None),
}


def dequantize(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The float weight [N, K] a layer's tensors stand for (exact in fp32 for the formats' scales)."""
    c, d, m = GROUP_FORMS[layout](stored, d, extra)
    n, k = c.shape
    w = c.float().view(n, k // GROUP, GROUP) * d[..., None]
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


def reference(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None) -> Kernel:
    """The format's definition, one row at a time, from the layer's per-group form (`GROUP_FORMS`)."""
    codes, d, m = GROUP_FORMS[layout](stored, d, extra)
    n = stored.shape[0]
    c64 = codes.to(torch.float64).view(n, -1, GROUP)
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


def native_path(suffix: str) -> Callable[..., Kernel]:
    """A C++ path's kernel builder: each layout's op (`OPS`) with the path's suffix."""

    def build(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None) -> Kernel:
        op = getattr(torch.ops.specstack_w4a8, OPS[layout] + suffix).default
        if extra is None:
            return lambda x: op(x.contiguous(), stored, d)
        return lambda x: op(x.contiguous(), stored, d, extra)

    return build


# a C++ path's ops for layers in their own layout: OPS[layout] + suffix
PATH_SUFFIX: Mapping[str, str] = {"vnni512": "_vnni", "avx2": ""}
vnni512, avx2 = native_path(PATH_SUFFIX["vnni512"]), native_path(PATH_SUFFIX["avx2"])


# The paths that keep a model's layers in the wide layout (models/w4a8_wide.py) where it fits them in place,
# and the suffix of their ops (models/kernels/w4a8_wide.cpp)
WIDE_PATHS: Mapping[str, str] = {"amx": "_amx", "wide512": ""}


def wide_path(name: str) -> Callable[..., Kernel]:
    """A wide path's kernel builder from a layer's tensors in its own layout: a wide copy of them. (A
    model's layers are rearranged in place instead, once after load, where their shapes allow:
    group_methods.GroupMethod.after_load; the rest run this.)"""

    def build(layout: str, stored: torch.Tensor, d: torch.Tensor, extra: torch.Tensor | None) -> Kernel:
        return w4a8_wide.padded_kernel(layout, stored, d, extra, WIDE_PATHS[name])

    return build


def _wide_library(dev: torch.device) -> bool:
    return dev.type == "cpu" and native.has_vnni512() and native.available("w4a8") and native.available("w4a8_wide")


KERNELS: tuple[LinearKernels, ...] = (
    KernelChoice("amx", lambda dev: _wide_library(dev) and native.has_amx(), wide_path("amx")),
    KernelChoice("wide512", _wide_library, wide_path("wide512")),
    KernelChoice("vnni512", lambda dev: dev.type == "cpu" and native.has_vnni512() and native.available("w4a8"),
                 vnni512),
    KernelChoice("avx2", lambda dev: dev.type == "cpu" and native.available("w4a8"), avx2),
    KernelChoice("reference", lambda dev: True, reference),
)
FORCE_ENV = "SPECSTACK_W4A8_KERNEL"  # a kernel's name: use it (tests run each path this CPU has)
# The layer formats narrower than q8a8 that a path may lack speed for, and the paths that run each at
# least as fast as q8a8 runs the same weights; elsewhere their GGUF types' layers are q8a8. The avx2
# path unpacks a 6-bit group with about twice the instructions per byte of an 8-bit one, more than the
# 27 % fewer bytes give back (docs/bench-history, "Q6_K's 6-bit groups"); its 5-bit groups cost 2 x
# q8a8's on the same weights at one row, where vnni512's cost 0.66 x ("The target step (issue 48,
# third session)").
NARROW_PATHS: dict[str, frozenset[str]] = {
    "k6a8": frozenset({"amx", "wide512", "vnni512", "reference"}),
    "q5a8": frozenset({"amx", "wide512", "vnni512", "reference"}),
}


def slow_layer_formats() -> frozenset[str]:
    """The narrow layer formats this process's path does not run fast (`NARROW_PATHS`): planned as q8a8."""
    path = kernel_for(torch.device("cpu")).name
    return frozenset(f for f, paths in NARROW_PATHS.items() if path not in paths)


def six_bit_groups() -> bool:
    """Whether GGUF Q6_K layers are planned as k6a8 (their own codes) or q8a8 in this process."""
    return "k6a8" not in slow_layer_formats()


def op_name(layout: str, device: torch.device) -> str | None:
    """The qualified name of the op that runs `layout` on this process's path (None: the reference)."""
    suffix = PATH_SUFFIX.get(kernel_for(device).name)
    return None if suffix is None else f"specstack_w4a8::{OPS[layout]}{suffix}"


def kernel_for(device: torch.device) -> LinearKernels:
    """The kernel this process uses on `device`: the forced one, else the first that applies."""
    return choose(KERNELS, FORCE_ENV, device)
