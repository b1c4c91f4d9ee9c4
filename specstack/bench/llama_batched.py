"""llama.cpp's own batched decoding as a peer: `llama-batched-bench` on the same GGUF (method
`llamacpp-batched`, batch mode only).

The binary is built from the llama.cpp tree vendored in llama-cpp-python's sdist by
benchmarks/build_llama_cpp.sh. It is looked for in --llama-bin-dir, then $SPECSTACK_LLAMA_BIN_DIR,
then PATH, then the build script's default folder. It runs once for all batch sizes and decodes
random tokens: B sequences of P prompt tokens each (P: the prompt set's mean length), then N new
tokens each in lockstep. Its `speed_tg` (generated tokens / generation seconds, prefill excluded) is
the method's tokens/s; `speed` over prefill and generation together is kept beside it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specstack.bench import children
from specstack.errors import SpecstackError

BINARY = "llama-batched-bench"
ENV_BIN_DIR = "SPECSTACK_LLAMA_BIN_DIR"
# benchmarks/build_llama_cpp.sh builds into $HOME/.cache/specstack/llama_cpp unless told otherwise
BUILD_DEFAULT = Path.home() / ".cache" / "specstack" / "llama_cpp" / "build" / "bin"
TASK_ID = "llama-batched-bench"  # the rows' task: random tokens, no prompt of the set
CTX_ROUND = 256  # llama.cpp pads contexts to 256; each sequence gets n_ctx / max B of it


def find_binary(bin_dir: Path | None, binary: str = BINARY) -> tuple[Path | None, str]:
    """(the binary, "") or (None, why it was not found): llama-batched-bench, or another binary the
    build script makes (llama-server)."""
    if bin_dir is None and os.environ.get(ENV_BIN_DIR):
        bin_dir = Path(os.environ[ENV_BIN_DIR])
    if bin_dir is not None:
        path = Path(bin_dir).expanduser() / binary
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"{binary} not found in {bin_dir} (build it: benchmarks/build_llama_cpp.sh)"
    on_path = shutil.which(binary)
    if on_path:
        return Path(on_path), ""
    path = BUILD_DEFAULT / binary
    if path.is_file() and os.access(path, os.X_OK):
        return path, ""
    return None, (f"{binary} not found (--llama-bin-dir DIR, ${ENV_BIN_DIR}, PATH or {BUILD_DEFAULT}); "
                  "build it with benchmarks/build_llama_cpp.sh")


@dataclass(frozen=True)
class LlamaBatched:
    """One run of llama-batched-bench over every batch size."""

    binary: Path
    gguf: Path
    prompt_tokens: int  # P, every sequence's
    new_tokens: int  # N
    batch_sizes: tuple[int, ...]
    threads: int

    @property
    def context(self) -> int:
        """Room for the largest batch: each of its sequences needs P + N (rounded as llama.cpp does)."""
        per_row = math.ceil((self.prompt_tokens + self.new_tokens) / CTX_ROUND) * CTX_ROUND
        return max(self.batch_sizes) * per_row

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "-c", str(self.context), "-b", "2048", "-ub", "512",
                "-npp", str(self.prompt_tokens), "-ntg", str(self.new_tokens),
                "-npl", ",".join(str(b) for b in self.batch_sizes), "-t", str(self.threads),
                "--output-format", "jsonl"]

    def run(self) -> list[dict[str, Any]]:
        """Its records (one per batch size it ran), or SpecstackError with the end of its output."""
        proc = children.run(self.command())
        records = parse_records(proc.stdout)
        if proc.returncode != 0 or not records:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise SpecstackError(f"{BINARY} failed (exit {proc.returncode}): {' / '.join(tail) or 'no output'}")
        return records


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON lines of its --output-format jsonl output (one per batch size; log lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and {"pl", "tg", "t_tg", "speed_tg"} <= set(record):
            out.append(record)
    return out


def record_rows(records: Sequence[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """One row per batch size: the whole batch (`aggregate`), its generated tokens over its generation
    time (`speed_tg`); `seconds_with_prefill` adds the prefill of its random prompts."""
    rows = []
    for rec in records:
        b, n = int(rec["pl"]), int(rec["tg"])
        rows.append({"task_id": TASK_ID, "method": f"{label}@b{b}", "base_method": label, "batch_size": b,
                     "batch": 0, "repeat": 0, "aggregate": True, "dtype": "gguf", "new_tokens": b * n,
                     "seconds": float(rec["t_tg"]), "tokens_per_s": float(rec["speed_tg"]),
                     "seconds_with_prefill": float(rec["t_pp"]) + float(rec["t_tg"]),
                     "prompt_tokens": int(rec["pp"]), "speed_pp": float(rec["speed_pp"]),
                     "target_forwards": None, "tau": None, "identical_to_ar": None})
    return rows
