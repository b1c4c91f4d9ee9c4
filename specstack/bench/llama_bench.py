"""llama.cpp's own forward times on the same GGUF, beside ours in `specstack bench-forward`: its
`llama-bench` (built by benchmarks/build_llama_cpp.sh with LLAMA_CPP_EXTRA=llama-bench, found as
llama-batched-bench is: bench/llama_batched.py) run once, as a separate process, after our timings.

What it measures, in our terms: `tg` (N tokens generated one at a time) is its one-token step; `ppT` (a
prompt of T tokens read in one batch) is its forward of T tokens. Both at the same context as ours
(`-d`, llama-bench's depth: the prompt the cache already holds), the same threads, the median over its
repetitions of the mean per run (llama-bench's own statistic is the mean; it keeps every sample, from
which the median is taken here, as our tables report medians).
"""
from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specstack.bench import children
from specstack.bench.llama_batched import find_binary
from specstack.errors import SpecstackError

BINARY = "llama-bench"
TG_TOKENS = 16  # tokens generated per tg run: enough for a steady step, short beside the pp runs


@dataclass(frozen=True)
class LlamaForward:
    """One llama-bench result: a forward of `tokens` tokens (tg: one token, `generated` of them)."""

    kind: str  # "tg" or "pp"
    tokens: int  # tokens a forward reads (1 for tg)
    median_ms: float  # one forward
    samples_ms: tuple[float, ...]


@dataclass(frozen=True)
class LlamaBench:
    binary: Path
    gguf: Path
    tokens: tuple[int, ...]  # the T of our forwards: llama-bench's pp sizes
    context: int
    threads: int
    repeats: int

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-p", ",".join(map(str, self.tokens)),
                "-n", str(TG_TOKENS), "-d", str(self.context), "-r", str(self.repeats), "-o", "json"]

    def run(self, timeout_s: float = 1800) -> list[LlamaForward]:
        """Its forwards, or SpecstackError with the end of its output (it is a peer: our run goes on)."""
        try:
            proc = children.run(self.command(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SpecstackError(f"{BINARY} did not finish in {timeout_s:.0f} s") from None
        except OSError as e:
            raise SpecstackError(f"{BINARY} could not start: {e}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise SpecstackError(f"{BINARY} exited with {proc.returncode}: {' | '.join(tail)[:300]}")
        return parse(proc.stdout)


def parse(text: str) -> list[LlamaForward]:
    """llama-bench's JSON (`-o json`: a list of records) -> one LlamaForward per record."""
    try:
        records: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecstackError(f"{BINARY} printed no JSON ({e})") from None
    if not isinstance(records, list):
        raise SpecstackError(f"{BINARY} printed {type(records).__name__}, not a list of results")
    out = []
    for r in records:
        n_prompt, n_gen, samples = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0)), r.get("samples_ns") or []
        if not samples or (n_prompt > 0) == (n_gen > 0):
            continue  # a combined pp+tg test: not a forward of ours
        per = n_gen if n_gen else 1  # tg: a run is n_gen one-token forwards; pp: one forward of n_prompt
        ms = tuple(s / 1e6 / per for s in samples)
        out.append(LlamaForward("tg" if n_gen else "pp", 1 if n_gen else n_prompt, statistics.median(ms), ms))
    if not out:
        raise SpecstackError(f"{BINARY} reported no forward")
    return out


def find(bin_dir: Path | None) -> tuple[Path | None, str]:
    return find_binary(bin_dir, BINARY)


def comparison_table(ours: dict[str, dict[int, float]], theirs: Sequence[LlamaForward],
                     tokens: Sequence[int]) -> str:
    """Per T: llama.cpp's forward (T = 1: its tg step, and pp1 beside it), each of our formats' and
    ours / llama.cpp's."""
    pp = {f.tokens: f.median_ms for f in theirs if f.kind == "pp"}
    tg = next((f.median_ms for f in theirs if f.kind == "tg"), None)

    def base(t: int) -> float | None:
        return tg if t == 1 and tg is not None else pp.get(t)

    head = "| T | llama.cpp (ms) | " + " | ".join(f"{f} (ms) | {f} / llama.cpp" for f in ours) + " |"
    lines = [head, "|---:|---:|" + "---:|---:|" * len(ours)]
    for t in tokens:
        ref = base(t)
        label = f"{ref:.1f}" if ref is not None else "-"
        if t == 1 and tg is not None and 1 in pp:
            label += f" (tg; pp1 {pp[1]:.1f})"
        cells = []
        for times in ours.values():
            mine = times.get(t)
            cells += ["-" if mine is None else f"{mine:.1f}",
                      "-" if mine is None or ref is None else f"{mine / ref:.2f}"]
        lines.append(f"| {t} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
