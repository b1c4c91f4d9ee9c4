"""What `specstack throughput` prints and writes for a grid of modelled rounds: the drafts of each
design, a text report (the target, the hardware, the critical batch and context, and per design a
table of the multiplier τ/Δt by batch B and context L) and the same cells as JSON.

Terms (model.py): N the matrix parameters a pass multiplies by, x the KV values cached per token,
Δt a round's time in target steps, L_crit / B_crit where verification stops being memory-bound.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from specstack.throughput.model import (
    CONVENTIONS,
    Cell,
    Conventions,
    Draft,
    Hardware,
    b_crit,
    l_crit,
    magicdec_draft,
    spire_draft,
    vanilla_draft,
)
from specstack.throughput.shapes import ModelShape


@dataclass(frozen=True)
class GridSpec:
    """One run's grid: the designs side by side, draft tokens per round, the axes, the conventions (a
    key of model.CONVENTIONS), the SPIRe draft's blocks and the sparse drafts' fixed KV window (None:
    1 + L // 8 positions)."""

    designs: list[str]
    k: int
    batches: list[int]
    contexts: list[int]
    conventions: str
    spire_layers: int = 2
    sparse_window: int | None = None

    @property
    def conv(self) -> Conventions:
        return CONVENTIONS[self.conventions]


def build_drafts(spec: GridSpec, target: ModelShape, draft: ModelShape, draft_dtype: str) -> list[Draft]:
    """The draft of each design in `spec.designs`: `draft` as the vanilla one, the SPIRe draft cut from
    the target (in `draft_dtype`), MagicDec the target itself."""
    made = {"vanilla": lambda: vanilla_draft(draft),
            "spire": lambda: spire_draft(target.in_format(draft_dtype), spec.spire_layers, spec.sparse_window),
            "magicdec": lambda: magicdec_draft(target, spec.sparse_window)}
    return [made[d]() for d in spec.designs]


def count(n: float) -> str:
    """A parameter count for reading: 134.5 M."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def _rate(value: float, unit: str) -> str:
    return "∞ (fitted to 0: the other terms cover it)" if value > 1e20 else f"{value / 1e9:,.1f} {unit}"


def rates(hw: Hardware) -> str:
    """The hardware's rates: its FLOP/byte ratio on a roofline machine, else F, BW and BW_kv."""
    if hw.overlap == "max":
        return f"HOI = {hw.hoi:.3g} FLOP/byte"
    return (f"F = {_rate(hw.flops_per_s, 'GFLOP/s')}, BW = {_rate(hw.bytes_per_s, 'GB/s')}, "
            f"BW_kv = {_rate(hw.kv_rate, 'GB/s')}")


def report(spec: GridSpec, target: ModelShape, drafts: list[Draft], cells: list[Cell], hw: Hardware) -> str:
    """The text report: a header (target, hardware, k and conventions, the critical batch and context),
    then per design with cells a markdown table of `multiplier (Δt)`, batches as rows, contexts as columns."""
    conv = spec.conv
    kind = "roofline (max)" if hw.overlap == "max" else "additive (FLOP and byte times add)"
    per_pass = f", {hw.seconds_per_pass * 1e3:.2f} ms per pass" if hw.seconds_per_pass else ""
    per_pass += f", {hw.seconds_per_layer * 1e3:.3f} ms per layer" if hw.seconds_per_layer else ""
    note = f" ({hw.note})" if hw.note else ""
    window = "1 + L // 8" if spec.sparse_window is None else spec.sparse_window
    lines = [
        (f"target {target.name}: N = {count(target.params)} matrix parameters, {target.n_layers} layers, "
         f"x = {target.kv_values_per_token:,} KV values/token, {target.fmt}"),
        f"hardware {hw.name}: {rates(hw)}, {kind}{per_pass}{note}",
        (f"k = {spec.k}; conventions {spec.conventions}: {conv.verify_tokens(spec.k)} tokens verified, "
         f"sparse KV {window} positions"),
    ]
    if hw.overlap == "max":
        lc = l_crit(target, hw, spec.k, conv)
        crit = ("∞ (verification never stays memory-bound at every batch)" if math.isinf(lc)
                else f"{lc:,.0f} tokens: from this context on, verification stays memory-bound at any batch")
        b_crits = ", ".join(f"L = {n:,}: " + (f"{b:,.1f}" if (b := b_crit(target, hw, n, spec.k, conv)) is not None
                                              else "none") for n in spec.contexts)
        lines += [f"L_crit = {crit}", f"B_crit (verification compute-bound from this batch on): {b_crits}"]
    else:
        lines.append("B_crit, L_crit: none on an additive machine (no roof: every verified token adds time)")
    for d in drafts:
        mine = [c for c in cells if c.design == d.design]
        if not mine:
            continue
        kv = "sparse KV" if d.sparse else "full KV"
        title = (f"## {d.design}: {d.shape.name} (N = {count(d.shape.params)}, {d.shape.n_layers} layers, {kv}, "
                 f"{d.shape.fmt}), τ = {mine[0].tau:.3f}")
        lines += ["", title, "",
                  "multiplier τ/Δt (Δt) by batch B (rows) and context L (columns)", "",
                  "| B \\ L | " + " | ".join(f"{n:,}" for n in spec.contexts) + " |",
                  "|---:|" + "---:|" * len(spec.contexts)]
        value = {(c.batch, c.context): c for c in mine}
        for b in spec.batches:
            lines.append(f"| {b} | " + " | ".join(f"{value[b, n].multiplier:.2f} ({value[b, n].round.delta_t:.2f})"
                                                 for n in spec.contexts) + " |")
    return "\n".join(lines)


def plot_title(spec: GridSpec, target: ModelShape, hw: Hardware) -> str:
    """The heat-map's title (plot.heatmap)."""
    return (f"{target.name} on {hw.name}, k = {spec.k}, conventions {spec.conventions}\n"
            "modelled throughput multiplier of speculative decoding")


def grid_json(spec: GridSpec, target: ModelShape, drafts: list[Draft], cells: list[Cell], hw: Hardware
              ) -> dict[str, Any]:
    """Every cell with its round's times, beside the target, hardware, conventions and drafts (--json)."""
    return {"target": asdict(target), "hardware": hw.to_json(), "conventions": asdict(spec.conv), "k": spec.k,
            "drafts": [asdict(d) for d in drafts],
            "cells": [{"design": c.design, "batch": c.batch, "context": c.context, "tau": c.tau,
                       "multiplier": c.multiplier, "delta_t": c.round.delta_t, **asdict(c.round)} for c in cells]}
