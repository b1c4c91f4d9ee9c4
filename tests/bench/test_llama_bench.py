"""llama.cpp's `llama-bench` beside our forwards in `specstack bench-forward` (bench/llama_bench.py):
its JSON read into one forward per record (tg per generated token, ppT per forward of T), the command
at our T, context and threads, the table of ours / llama.cpp, and a peer that is missing, crashes or
prints nothing useful reported as one line while the run goes on (a fake binary, as the batched bench's
tests do)."""
from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from specstack.bench import llama_bench
from specstack.bench.forward import run_llama_bench
from specstack.bench.forward_report import ForwardSettings
from specstack.errors import SpecstackError

# two records as llama-bench 0c1e570 writes them (fields trimmed to those read, plus a few others)
RECORDS = [
    {"n_prompt": 4, "n_gen": 0, "n_depth": 256, "n_threads": 2, "avg_ns": 60_000_000,
     "samples_ns": [58_000_000, 60_000_000, 70_000_000]},
    {"n_prompt": 0, "n_gen": 16, "n_depth": 256, "n_threads": 2, "avg_ns": 560_000_000,
     "samples_ns": [560_000_000, 544_000_000, 600_000_000]},
    {"n_prompt": 4, "n_gen": 16, "samples_ns": [1]},  # a combined test: not a forward
]


def test_records_become_forwards_per_token_and_per_batch():
    pp, tg = llama_bench.parse(json.dumps(RECORDS))
    assert (pp.kind, pp.tokens, pp.median_ms) == ("pp", 4, 60.0) and pp.samples_ms == (58.0, 60.0, 70.0)
    assert (tg.kind, tg.tokens) == ("tg", 1) and tg.median_ms == pytest.approx(35.0)  # 560 ms / 16 tokens
    for bad, why in [("not json", "no JSON"), ("{}", "not a list"), ("[]", "no forward")]:
        with pytest.raises(SpecstackError, match=why):
            llama_bench.parse(bad)


def test_the_command_times_our_tokens_at_our_context_and_threads():
    run = llama_bench.LlamaBench(Path("/bin/llama-bench"), Path("m.gguf"), (1, 4, 16), 256, 2, 5)
    cmd = run.command()
    assert cmd[cmd.index("-p") + 1] == "1,4,16" and cmd[cmd.index("-d") + 1] == "256"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-r") + 1] == "5" and cmd[-2:] == ["-o", "json"]


def test_the_table_puts_ours_over_llama_cpp_per_token_count():
    forwards = llama_bench.parse(json.dumps(RECORDS))
    table = llama_bench.comparison_table({"w4a8": {1: 42.0, 4: 30.0}, "int4": {1: 70.0}}, forwards, [1, 4, 8])
    lines = table.splitlines()
    assert lines[0] == "| T | llama.cpp (ms) | w4a8 (ms) | w4a8 / llama.cpp | int4 (ms) | int4 / llama.cpp |"
    assert lines[2] == "| 1 | 35.0 | 42.0 | 1.20 | 70.0 | 2.00 |"  # T = 1 against its tg step
    assert lines[3] == "| 4 | 60.0 | 30.0 | 0.50 | - | - |"
    assert lines[4] == "| 8 | - | - | - | - | - |"  # llama.cpp did not time it


def _fake(tmp_path: Path, body: str) -> Path:
    fake = tmp_path / llama_bench.BINARY
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def _settings(tmp_path: Path, bin_dir: Path | None, skip: bool = False) -> ForwardSettings:
    return ForwardSettings(model="m.gguf", formats=["w4a8"], tokens=[1, 4], rows=[1], ragged=False, chunks=[],
                           context=256, repeats=3, warmup=0, prompts=0, new_tokens=1, threads=2, hf_dtypes=[],
                           skip_hf=True, out=tmp_path / "o.json", llama_bin_dir=bin_dir, skip_llama=skip)


def test_a_peer_that_runs_fails_or_is_missing_is_one_line_and_the_run_goes_on(tmp_path):
    gguf = SimpleNamespace(kind="gguf", path=tmp_path / "m.gguf")
    (tmp_path / "ok").mkdir()
    ok = _fake(tmp_path / "ok", f"cat <<'EOF'\n{json.dumps(RECORDS)}\nEOF\n")
    got, notes = run_llama_bench(_settings(tmp_path, ok), gguf)
    assert [f.kind for f in got] == ["pp", "tg"] and notes[0].startswith("llama-bench: `")
    (tmp_path / "crash").mkdir()
    crash = _fake(tmp_path / "crash", "echo 'ggml_abort: oops' >&2\nkill -SEGV $$\n")
    got, notes = run_llama_bench(_settings(tmp_path, crash), gguf)
    assert got == [] and notes[0].startswith("llama-bench: failed (llama-bench exited with -11") and "oops" in notes[0]
    got, notes = run_llama_bench(_settings(tmp_path, tmp_path / "nowhere"), gguf)
    assert got == [] and "llama-bench: not run (llama-bench not found in" in notes[0]
    got, notes = run_llama_bench(_settings(tmp_path, ok), SimpleNamespace(kind="hf", path=tmp_path))
    assert got == [] and "is not a GGUF file" in notes[0]
    assert run_llama_bench(_settings(tmp_path, ok, skip=True), gguf) == ([], [])
