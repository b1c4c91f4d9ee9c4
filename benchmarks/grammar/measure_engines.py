"""What benchmarks/grammar/engines.py measures of one engine: a grammar's walk over its document (compile,
masks cold and after reset(), forced tokens and how much they cover, accepts, rollback and re-advance;
`measure_case`) and applying a bitmask to a row of logits (`measure_apply`, with an engine-independent
torch reference)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from engine_api import VOCAB, Engine
from grammar_cases import Case

K_ROLLBACK = 4
APPLY_REPS = 200


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return (int(bitmask[0, token >> 5]) >> (token & 31)) & 1 == 1


def _us(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"median": round(float(np.median(a)), 2), "p90": round(float(np.percentile(a, 90)), 2), "n": len(ns)}


@dataclass
class CaseResult:
    engine: str
    grammar: str
    tokens: int
    compile_ms: float = float("nan")
    first_mask_us: float = float("nan")
    mask_us: dict[str, float] = field(default_factory=dict)  # cold walk, first mask excluded
    mask_warm_us: dict[str, float] = field(default_factory=dict)  # same grammar after reset()
    allowed_mean: float = float("nan")  # tokens the mask allows, averaged over positions
    accept_us: dict[str, float] = field(default_factory=dict)
    forced_us: dict[str, float] = field(default_factory=dict)
    forced_positions: int = 0  # positions where the engine found a non-empty forced continuation
    forced_tokens_matching: int = 0  # document tokens covered by forced tokens equal to the document's
    forced_bytes_covered: int = 0  # document bytes covered by a forced byte string
    doc_bytes: int = 0
    rollback_us: dict[str, float] = field(default_factory=dict)
    readvance_us: dict[str, float] = field(default_factory=dict)  # accepting the K tokens again
    eos_allowed_at_end: bool = False
    error: str | None = None


def measure_case(engine: Engine, case: Case, tokens: list[int], pieces: list[bytes], eos: int) -> CaseResult:
    r = CaseResult(engine.name, case.name, len(tokens), doc_bytes=sum(map(len, pieces)))
    try:
        t0 = time.perf_counter_ns()
        m = engine.compile(case)
        r.compile_ms = round((time.perf_counter_ns() - t0) / 1e6, 2)
    except Exception as e:  # an unsupported grammar is a result, not a crash
        r.error = f"compile: {type(e).__name__}: {e}"[:300]
        return r

    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(int)
    doc = b"".join(pieces)
    covered_tok = np.zeros(len(tokens), dtype=bool)
    covered_byte = np.zeros(len(doc), dtype=bool)
    masks: list[int] = []
    accepts: list[int] = []
    forced: list[int] = []
    allowed: list[int] = []
    for i, t in enumerate(tokens):
        t0 = time.perf_counter_ns()
        m.fill(bitmask)
        masks.append(time.perf_counter_ns() - t0)
        allowed.append(int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum()))
        if not _allowed(bitmask, t):
            r.error = f"token {i} ({pieces[i]!r}) masked out; {m.error() or ''}"[:300]
            break
        t0 = time.perf_counter_ns()
        ff = m.forced_tokens()
        forced.append(time.perf_counter_ns() - t0)
        fb = m.forced_bytes()
        if ff or fb:
            r.forced_positions += 1
        if ff and tokens[i:i + len(ff)] == ff:
            covered_tok[i:i + len(ff)] = True
        if fb and doc[offsets[i]:].startswith(fb):
            covered_byte[offsets[i]:offsets[i] + len(fb)] = True
        t0 = time.perf_counter_ns()
        ok = m.accept(t)
        accepts.append(time.perf_counter_ns() - t0)
        if not ok:
            r.error = f"accept token {i} ({pieces[i]!r}) refused; {m.error() or ''}"[:300]
            break
    else:
        m.fill(bitmask)
        r.eos_allowed_at_end = _allowed(bitmask, eos)
    r.first_mask_us = round(masks[0] / 1e3, 2) if masks else float("nan")
    r.mask_us = _us(masks[1:])
    r.accept_us = _us(accepts)
    r.forced_us = _us(forced)
    r.allowed_mean = round(statistics.fmean(allowed), 1) if allowed else float("nan")
    r.forced_tokens_matching = int(covered_tok.sum())
    r.forced_bytes_covered = int(covered_byte.sum())
    if r.error:
        return r

    # Warm walk: same matcher after reset() (llguidance keeps its lazily built lexer states).
    m.reset()
    warm: list[int] = []
    for t in tokens:
        t0 = time.perf_counter_ns()
        m.fill(bitmask)
        warm.append(time.perf_counter_ns() - t0)
        m.accept(t)
    r.mask_warm_us = _us(warm[1:])

    # Rollback walk: after each token from the K-th on, roll back K and accept the same K again.
    m.reset()
    rb: list[int] = []
    ra: list[int] = []
    try:
        for i, t in enumerate(tokens):
            if not m.accept(t):
                raise RuntimeError(f"accept {i} refused in the rollback walk; {m.error() or ''}")
            if i + 1 >= K_ROLLBACK:
                t0 = time.perf_counter_ns()
                m.rollback(K_ROLLBACK)
                t1 = time.perf_counter_ns()
                ok = m.accept_many(tokens[i + 1 - K_ROLLBACK:i + 1])
                t2 = time.perf_counter_ns()
                if not ok:
                    raise RuntimeError(f"re-advance at {i} refused; {m.error() or ''}")
                rb.append(t1 - t0)
                ra.append(t2 - t1)
    except Exception as e:
        r.error = f"rollback: {type(e).__name__}: {e}"[:300]
    r.rollback_us = _us(rb)
    r.readvance_us = _us(ra)
    return r


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_torch_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Engine-independent reference: unpack the bits with a broadcast shift, then one masked_fill_."""
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).flatten(1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class TorchEager:
    name = "torch_eager"
    apply = staticmethod(apply_torch_eager)


def measure_apply(engine: Any, bitmask: torch.Tensor) -> dict[str, float]:
    base = torch.randn(1, VOCAB, dtype=torch.float32)
    logits = base.clone()
    t0 = time.perf_counter_ns()
    engine.apply(logits, bitmask)  # first call: llguidance's helper is torch.compile'd here
    first = time.perf_counter_ns() - t0
    ns: list[int] = []
    for _ in range(APPLY_REPS):
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        engine.apply(logits, bitmask)
        ns.append(time.perf_counter_ns() - t0)
    want = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB].astype(bool))
    correct = bool(torch.equal(torch.isinf(logits[0]), ~want))
    return {"first_ms": round(first / 1e6, 2), **_us(ns), "correct": correct}
