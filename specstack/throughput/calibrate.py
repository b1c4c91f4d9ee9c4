"""Fit this machine's own hardware preset from measured forwards (`specstack throughput-calibrate`).

The foundation's forward benchmark (bench/forward.py: prefill a context once, then time forwards of
T query tokens that never commit) times the target and a draft at a few T and contexts, both models
interleaved so they see the same machine. Every timed pass has a known cost (throughput.pass_cost:
FLOPs, weight bytes, KV bytes, layers), and the fit is

    seconds = c0 + c_layer · layers + FLOPs / F + weight bytes / BW + KV bytes / BW_kv

by non-negative least squares on relative errors. A sum, not the roofline's max: on a CPU the int4
kernels are bound by unpacking weights, which competes with the multiply for the same two cores, so
a forward's time grows with T from the first token on (DESIGN §3 table) instead of staying flat
until a compute roof. c0 and c_layer are dispatch: eager PyTorch launches ~25 small operators per
block, a sizeable share of a small model's one-token step (DESIGN §3; docs/bench-history, "Against
the foundation targets"). Each point is the median of its repeats, the
statistic bench-forward reports: on a shared machine the fastest repeat describes an idle machine,
while generation (and `specstack bench`) runs at the typical speed, and longer forwards lose more
to interference than short ones. Measurements are at batch 1, so predictions for larger batches
extrapolate the FLOP term.

With only self-drafts of one model, layers and weight bytes move together (every block has the same
size), so c_layer and BW cannot be told apart: the fit keeps whichever explains the times (a zero
for the other), which predicts any depth of that model; a draft of another width separates them.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specstack.bench.forward import context_ids, time_forwards
from specstack.engine.draft_sources import DraftSources, load_draft
from specstack.engine.timing import forward_steps
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text
from specstack.machine import cpu_model, now, versions
from specstack.models.base import LoadedModel
from specstack.models.drafts import choose_draft
from specstack.models.loading import load_model
from specstack.throughput.hardware import LOCAL
from specstack.throughput.model import (
    ENGINE,
    Conventions,
    Hardware,
    PassCost,
    pass_cost,
)
from specstack.throughput.report import rates
from specstack.throughput.shapes import ModelShape, from_config

_TINY = 1e-30  # a coefficient fitted to 0: that resource costs nothing measurable here


@dataclass(frozen=True)
class Sample:
    model: str
    layers: int
    tokens: int
    context: int
    seconds: float  # median of the repeats
    cost: PassCost


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    samples: list[Sample]
    max_rel_error: float
    mean_rel_error: float
    machine: dict[str, Any]

    def predicted(self, s: Sample) -> float:
        return self.hardware.seconds(s.cost)

    def to_json(self) -> dict[str, Any]:
        return {"hardware": self.hardware.to_json(), "max_rel_error": self.max_rel_error,
                "mean_rel_error": self.mean_rel_error, "machine": self.machine,
                "samples": [asdict(s) | {"predicted": self.predicted(s)} for s in self.samples]}


# ---------------------------------------------------------------------------------------------------
# Fitting (numpy only)
# ---------------------------------------------------------------------------------------------------
def _design_matrix(samples: Sequence[Sample]) -> np.ndarray:
    return np.array([[1.0, s.cost.layers, s.cost.flops, s.cost.weight_bytes, s.cost.kv_bytes] for s in samples])


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, exactly, by trying every set of free columns (5 here)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b * b))
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < r:
                continue
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(cols)] = x
    return best


def fit(samples: Sequence[Sample], name: str = LOCAL, fmt: str = "int4", note: str = "") -> Hardware:
    """The additive model of the module docstring, fitted on relative errors (each row / its time)."""
    if len(samples) < 4:
        raise SpecstackError(f"calibration needs at least 4 timed passes, got {len(samples)}")
    t = np.array([s.seconds for s in samples])
    if np.any(t <= 0):
        raise SpecstackError("calibration: every timed pass must take a positive time")
    a = _design_matrix(samples) / t[:, None]
    scale = np.max(np.abs(a), axis=0)  # columns in very different units (1, FLOPs, bytes): equilibrate
    scale[scale == 0] = 1.0
    x = nnls(a / scale, np.ones(len(samples))) / scale
    c0, per_layer, per_flop, per_byte, per_kv_byte = (float(v) for v in x)
    return Hardware(name, 1.0 / max(per_flop, _TINY), 1.0 / max(per_byte, _TINY), 1.0 / max(per_kv_byte, _TINY),
                    overlap="sum", seconds_per_pass=c0, seconds_per_layer=per_layer, fmt=fmt, note=note)


def errors(hw: Hardware, samples: Sequence[Sample]) -> list[float]:
    return [abs(hw.seconds(s.cost) - s.seconds) / s.seconds for s in samples]


# ---------------------------------------------------------------------------------------------------
# Measuring (torch)
# ---------------------------------------------------------------------------------------------------
def measure(models: Sequence[tuple[LoadedModel, ModelShape]], tokenizer: Any, contexts: Sequence[int],
            tokens: Sequence[int], repeats: int, warmup: int, conv: Conventions = ENGINE) -> list[Sample]:
    """Median of `repeats` chain forwards of T tokens at each context, for every (model, shape),
    the models interleaved in one run of bench/forward.py's protocol per context."""
    out: list[Sample] = []
    for ctx in contexts:
        steps, shapes = {}, {}
        for lm, shape in models:
            if ctx + max(tokens) > lm.config.max_seq_len:
                raise SpecstackError(f"context {ctx} + {max(tokens)} tokens exceeds {lm.name}'s "
                                     f"{lm.config.max_seq_len}")
            ids = context_ids(tokenizer, ctx, lm.config.vocab_size)
            for name, step in forward_steps(lm, ids, max(tokens)).items():
                if name.endswith(" chain"):
                    steps[f"{lm.name} chain"] = step
                    shapes[f"{lm.name} chain"] = (lm.name, shape)
        vocab = min(lm.config.vocab_size for lm, _ in models)
        for row in time_forwards(steps, tokens, vocab, repeats, warmup):
            name, shape = shapes[row.method]
            out.append(Sample(name, shape.n_layers, row.tokens, ctx, row.median_ms / 1e3,
                              pass_cost(shape, 1, row.tokens, ctx, conv)))
    return out


def calibrate(model: str, dtype: str, draft: str | None, draft_dtype: str, contexts: Sequence[int],
              tokens: Sequence[int], repeats: int, warmup: int, threads: int | None) -> Calibration:
    """Time the target and the draft (default: the engine's default draft for the model) and fit."""
    if threads is not None:
        torch.set_num_threads(threads)
    target = load_model(model, dtype=dtype)
    if target.tokenizer is None:
        raise SpecstackError(f"{model} has no tokenizer: calibration times forwards over real text")
    spec = str(choose_draft(draft, target.config.n_layers, target.name))
    drafted = load_draft(target, DraftSources(draft=spec, draft_dtype=draft_dtype), "cpu")
    models = [(lm, from_config(lm.config, lm.name, fmt)) for lm, fmt in ((target, dtype), (drafted, draft_dtype))]
    samples = measure(models, target.tokenizer, contexts, tokens, repeats, warmup)
    machine = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": versions()["torch"], "date": now(),
               "model": model, "dtype": dtype, "draft": spec, "draft_dtype": draft_dtype}
    note = f"{machine['cpu']}, {machine['threads']} threads, fitted on {model} {dtype} + {spec} {draft_dtype}"
    hw = fit(samples, LOCAL, dtype, note)
    errs = errors(hw, samples)
    return Calibration(hw, samples, max(errs), sum(errs) / len(errs), machine)


def summary(cal: Calibration) -> str:
    """What throughput-calibrate prints: the fitted formula and rates, every timed pass against the
    fit's prediction, and the relative errors."""
    hw = cal.hardware
    lines = [f"fitted on {cal.machine['cpu']}, {cal.machine['threads']} threads: seconds = "
             f"{hw.seconds_per_pass * 1e3:.2f} ms + {hw.seconds_per_layer * 1e3:.3f} ms x layers "
             f"+ FLOPs / F + weight bytes / BW + KV bytes / BW_kv; {rates(hw)}",
             "", "| model | layers | T | context | measured ms | model ms | error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for s in cal.samples:
        pred = cal.predicted(s)
        lines.append(f"| {s.model} | {s.layers} | {s.tokens} | {s.context} | {s.seconds * 1e3:.2f} | {pred * 1e3:.2f} "
                     f"| {pred / s.seconds - 1:+.1%} |")
    lines += ["", f"relative error: mean {cal.mean_rel_error:.1%}, max {cal.max_rel_error:.1%}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The preset on disk (hardware.load_hardware reads it back)
# ---------------------------------------------------------------------------------------------------
def save(cal: Calibration, path: Path) -> None:
    """The calibration as JSON: the fitted hardware, its samples and the machine they were timed on."""
    atomic_write_text(path, json.dumps(cal.to_json(), indent=1) + "\n", parents=True)
