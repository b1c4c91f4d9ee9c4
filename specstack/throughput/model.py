"""SPIRe's implementation-agnostic throughput model (DESIGN §7): how much faster speculative decoding
generates than autoregressive decoding, from each pass's FLOPs and bytes, without a serving stack.

A speculation round runs the draft k times and the target once over the drafts (verification);
autoregressive decoding runs the target once per token. With τ tokens emitted per round (measured),

    Δt = (k · t_draft + t_verify) / t_target,      multiplier = τ / Δt.

A pass of T tokens for each of B sequences at context L costs, on hardware of peak F FLOP/s and
bandwidth BW bytes/s, max(FLOPs / F, bytes / BW) (the roofline; in FLOP units max(FLOPs, bytes · HOI),
HOI = F / BW), where FLOPs = 2 · N · B · T and bytes = weights + KV = W + B · L_kv · x (x = 2 · layers ·
kv_heads · head_dim values per cached token). A calibrated machine (calibrate.py) adds the two times
instead of taking the larger, plus fixed costs per pass and per layer: what small forwards on a CPU
look like.

Drafts: vanilla (a small model, full KV), SPIRe (a few target-shaped blocks with a sparse KV that also
projects the target's memories into keys and values every pass: 2 · (2 · layers · kv_heads · d_model ·
head_dim) · B FLOPs) and MagicDec (the target's own weights with a sparse KV). Sparse drafts keep
L_kv = sink + L // 8 positions (sink 1).

Verification turns compute-bound at B_crit = HOI · W / (2 · N · v − HOI · L · x) and stays memory-bound
at any batch from L_crit = 2 · N · v / (HOI · x) on (v: tokens verified; one byte per value). Which v?
The engine scores the root plus the k drafts, v = k + 1 (`ENGINE`); the paper's L_crit (≈ 55 tokens
for its 67M target at k = 4, ≈ 5,600 for Llama-3-70B) comes out of v = k, so `PUBLISHED` uses that.
Its published multipliers (L = 512, far past L_crit) do not depend on the choice.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from specstack.errors import SpecstackError
from specstack.throughput.shapes import ModelShape

DESIGNS = ("vanilla", "spire", "magicdec")


@dataclass(frozen=True)
class Conventions:
    """How passes are counted. verify_extra: verification scores k + verify_extra tokens.
    attention_flops: count attention's 4 · T · L_kv · q_dim FLOPs per layer (the paper does not; they
    matter little while attention is memory-bound). Sparse drafts keep sink + L // window_divisor."""

    verify_extra: int = 1
    attention_flops: bool = True
    sink: int = 1
    window_divisor: int = 8

    def __post_init__(self) -> None:
        if self.verify_extra not in (0, 1):
            raise SpecstackError(f"verify_extra must be 0 (k tokens) or 1 (k + 1), got {self.verify_extra}")
        if self.sink < 0 or self.window_divisor < 1:
            raise SpecstackError(f"invalid sparse KV: sink={self.sink}, divisor={self.window_divisor}")

    def verify_tokens(self, k: int) -> int:
        # k = 0 is plain decoding: the "verification" is the target's one-token step
        return k + self.verify_extra if k > 0 else 1

    def sparse_positions(self, context: int) -> int:
        return min(context, self.sink + context // self.window_divisor)


ENGINE = Conventions()
PUBLISHED = Conventions(verify_extra=0, attention_flops=False)
CONVENTIONS: dict[str, Conventions] = {"engine": ENGINE, "published": PUBLISHED}


@dataclass(frozen=True)
class Draft:
    design: str  # vanilla | spire | magicdec
    shape: ModelShape
    sparse: bool = False  # keeps sink + L // divisor positions (or `window` if given)
    window: int | None = None  # a fixed sparse KV size instead of the proportional one
    memory_projection: bool = False  # SPIRe: projects target memories into K/V every pass

    def kv_positions(self, context: int, conv: Conventions) -> int:
        n = min(context, self.shape.window or context)
        if self.sparse:
            n = min(n, self.window if self.window is not None else conv.sparse_positions(context))
        return n


def vanilla_draft(shape: ModelShape) -> Draft:
    return Draft("vanilla", shape)


def spire_draft(target: ModelShape, layers: int = 2, window: int | None = None) -> Draft:
    """SPIRe: `layers` target-shaped blocks (the paper prunes the target to its last two) and the head."""
    return Draft("spire", target.first_layers(layers, name=f"spire[{layers} of {target.name}]"),
                 sparse=True, window=window, memory_projection=True)


def magicdec_draft(target: ModelShape, window: int | None = None) -> Draft:
    return Draft("magicdec", target, sparse=True, window=window)


# ---------------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassCost:
    flops: float
    weight_bytes: float
    kv_bytes: float
    layers: int = 0  # decoder blocks run (a calibrated machine's per-layer dispatch cost)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Hardware:
    """Peak FLOP/s and bandwidth. overlap "max": compute and memory traffic overlap (a roofline, the
    published model); "sum": they do not (a calibrated CPU). kv_bytes_per_s: the KV cache's own
    bandwidth when calibrated apart from the weights' (None: the same). seconds_per_pass and
    seconds_per_layer: fixed costs of launching a forward and its blocks' small operators (zero for
    the implementation-agnostic presets). fmt: the weight format it is for."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    kv_bytes_per_s: float | None = None
    overlap: Literal["max", "sum"] = "max"
    seconds_per_pass: float = 0.0
    seconds_per_layer: float = 0.0
    fmt: str = "fp8"
    note: str = ""

    def __post_init__(self) -> None:
        rates = (self.flops_per_s, self.bytes_per_s, self.kv_bytes_per_s or 1.0)
        if not all(math.isfinite(r) and r > 0 for r in rates):
            raise SpecstackError(f"hardware {self.name!r}: FLOP/s and bandwidths must be positive")
        if self.overlap not in ("max", "sum"):
            raise SpecstackError(f"hardware {self.name!r}: overlap must be max or sum, got {self.overlap!r}")
        if not (self.seconds_per_pass >= 0 and self.seconds_per_layer >= 0):
            raise SpecstackError(f"hardware {self.name!r}: fixed costs per pass and per layer must be >= 0")

    @property
    def hoi(self) -> float:
        """Hardware operational intensity, FLOP per byte."""
        return self.flops_per_s / self.bytes_per_s

    @property
    def kv_rate(self) -> float:
        return self.kv_bytes_per_s or self.bytes_per_s

    def flop_seconds(self, cost: PassCost) -> float:
        return cost.flops / self.flops_per_s

    def byte_seconds(self, cost: PassCost) -> float:
        return cost.weight_bytes / self.bytes_per_s + cost.kv_bytes / self.kv_rate

    def seconds(self, cost: PassCost) -> float:
        f, b = self.flop_seconds(cost), self.byte_seconds(cost)
        fixed = self.seconds_per_pass + self.seconds_per_layer * cost.layers
        return fixed + (max(f, b) if self.overlap == "max" else f + b)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Hardware:
        try:
            return Hardware(**{k: data[k] for k in Hardware.__dataclass_fields__ if k in data})
        except TypeError as e:
            raise SpecstackError(f"not a hardware description: {e}") from None


# Data-sheet numbers (dense). H100 SXM: 1,979 TFLOP/s FP8 over 3.35 TB/s is HOI ≈ 590; the paper
# rounds it to 600, which is what reproduces its numbers. A100 SXM: 312 TFLOP/s bf16, 2.04 TB/s.
# RTX 4090: 165 TFLOP/s fp16 with fp32 accumulation, 1.01 TB/s.
PRESETS: dict[str, Hardware] = {
    "h100-fp8": Hardware("h100-fp8", 600 * 3.35e12, 3.35e12, fmt="fp8", note="H100 SXM, FP8, HOI 600 (SPIRe)"),
    "a100-bf16": Hardware("a100-bf16", 312e12, 2.039e12, fmt="bf16", note="A100 SXM 80GB, bf16"),
    "rtx4090-fp16": Hardware("rtx4090-fp16", 165.2e12, 1.008e12, fmt="bf16", note="RTX 4090, fp16/bf16"),
}


# ---------------------------------------------------------------------------------------------------
# Passes and rounds
# ---------------------------------------------------------------------------------------------------
def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecstackError(f"{name} must be an integer >= {low}, got {value!r}")


def pass_cost(shape: ModelShape, batch: int, tokens: int, kv_positions: int, conv: Conventions,
              memory_projection: bool = False) -> PassCost:
    """One forward of `tokens` tokens for each of `batch` sequences reading `kv_positions` cached positions."""
    flops = 2.0 * shape.params * batch * tokens
    if conv.attention_flops:  # q·K and p·V: 2 FLOPs per multiply-add each, per layer
        flops += 4.0 * batch * tokens * kv_positions * shape.q_dim * shape.n_layers
    if memory_projection:
        flops += 2.0 * (2 * shape.n_layers * shape.n_kv_heads * shape.d_model * shape.head_dim) * batch
    return PassCost(flops, shape.weight_bytes, float(batch) * kv_positions * shape.kv_bytes_per_token, shape.n_layers)


@dataclass(frozen=True)
class Round:
    """Seconds of one autoregressive target step, one draft pass and the verification pass."""

    k: int
    t_target: float
    t_draft: float
    t_verify: float
    verify_compute_bound: bool

    @property
    def delta_t(self) -> float:
        return (self.k * self.t_draft + self.t_verify) / self.t_target

    def multiplier(self, tau: float) -> float:
        check_tau(tau, self.k)
        return tau / self.delta_t


def check_tau(tau: float, k: int) -> None:
    """τ counts the tokens of a round: the target's own token plus the accepted drafts, so 1 ≤ τ ≤ k + 1."""
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and 1 <= tau <= k + 1):
        raise SpecstackError(f"tau must be in [1, k + 1] = [1, {k + 1}] (tokens per round), got {tau!r}")


def round_times(target: ModelShape, draft: Draft, hw: Hardware, batch: int, context: int, k: int,
                conv: Conventions = ENGINE) -> Round:
    _check_int("batch", batch, 1)
    _check_int("context", context, 1)
    _check_int("k", k, 0)
    kv = min(context, target.window or context)
    t_target = hw.seconds(pass_cost(target, batch, 1, kv, conv))
    verify = pass_cost(target, batch, conv.verify_tokens(k), kv, conv)
    t_verify = hw.seconds(verify)
    t_draft = 0.0
    if k > 0:
        t_draft = hw.seconds(pass_cost(draft.shape, batch, 1, draft.kv_positions(context, conv), conv,
                                       draft.memory_projection))
    return Round(k, t_target, t_draft, t_verify, hw.flop_seconds(verify) >= hw.byte_seconds(verify))


def _verify_rates(target: ModelShape, hw: Hardware, context: int, k: int, conv: Conventions
                  ) -> tuple[float, float, float]:
    """Verification time per sequence is a·B (FLOPs) against w + c·B (bytes): returns (a, c, w)."""
    v = conv.verify_tokens(k)
    kv = min(context, target.window or context)
    one = pass_cost(target, 1, v, kv, conv)
    return one.flops / hw.flops_per_s, one.kv_bytes / hw.kv_rate, one.weight_bytes / hw.bytes_per_s


def b_crit(target: ModelShape, hw: Hardware, context: int, k: int, conv: Conventions = ENGINE) -> float | None:
    """The batch from which verification is compute-bound; None when it never is (context ≥ L_crit)."""
    _check_int("context", context, 1)
    _check_int("k", k, 0)
    a, c, w = _verify_rates(target, hw, context, k, conv)
    return w / (a - c) if a > c else None


def l_crit(target: ModelShape, hw: Hardware, k: int, conv: Conventions = ENGINE) -> float:
    """The context from which verification stays memory-bound at any batch (math.inf: never)."""
    _check_int("k", k, 0)
    v = conv.verify_tokens(k)
    flops_per_seq = 2.0 * target.params * v / hw.flops_per_s  # the FLOPs that do not grow with L
    per_position = target.kv_bytes_per_token / hw.kv_rate
    if conv.attention_flops:
        per_position -= 4.0 * v * target.q_dim * target.n_layers / hw.flops_per_s
    if per_position <= 0:
        return math.inf
    crit = flops_per_seq / per_position
    return math.inf if target.window is not None and crit >= target.window else crit


# ---------------------------------------------------------------------------------------------------
# A grid over batch x context, for each draft design
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    design: str
    batch: int
    context: int
    tau: float
    round: Round

    @property
    def multiplier(self) -> float:
        return self.round.multiplier(self.tau)


def grid(target: ModelShape, drafts: Sequence[Draft], taus: Mapping[str, float], batches: Sequence[int],
         contexts: Sequence[int], k: int, hw: Hardware, conv: Conventions = ENGINE) -> list[Cell]:
    """Every (design, batch, context) whose design has a τ, in that order."""
    cells = []
    for d in drafts:
        if d.design not in taus:
            continue
        check_tau(taus[d.design], k)
        cells += [Cell(d.design, b, n, taus[d.design], round_times(target, d, hw, b, n, k, conv))
                  for b in batches for n in contexts]
    return cells
