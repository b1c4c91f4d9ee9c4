"""The command line stays light where it can: `specstack --help` and the cheap argument errors never
import torch (each command imports its logic only when it runs: specstack/cli/common.py), `--version`
prints the installed version, and every command, bench-forward included, reports bad input as one
line `specstack: error: ...` with exit status 2."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from specstack.cli.app import build_parser


def run_entry_point(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`python -X importtime -m specstack.cli ARGS`: the process and every module it imported."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "specstack.cli", *argv],
                       capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "specstack.cli.app" in modules, "importtime listed no modules: the check would prove nothing"
    return p, modules


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def torch_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "torch" or m.startswith("torch."))


def test_help_does_not_import_torch():
    p, modules = run_entry_point("--help")
    assert p.returncode == 0, p.stderr
    for command in ("generate", "bench", "bench-forward", "bench-ties", "ngram", "throughput", "throughput-calibrate",
                    "throughput-check", "train-draft", "draft-acceptance", "doctor"):
        assert command in p.stdout
    assert torch_modules(modules) == []


@pytest.mark.parametrize("argv, phrase", [
    (("generate", "--prompt", "hi", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
    (("bench", "--prompts", "humaneval", "--methods", "ar", "--out", "o", "--limit", "0"), "--limit must be >= 1, got 0"),
    (("bench-forward", "--context", "0"), "--context must be >= 1, got 0"),
], ids=["generate", "bench", "bench-forward"])
def test_cheap_errors_do_not_import_torch(argv, phrase):
    p, modules = run_entry_point(*argv)
    assert p.returncode == 2 and p.stdout == ""
    (line,) = error_lines(p.stderr)
    assert line.startswith("specstack: error: ") and phrase in line, line
    assert torch_modules(modules) == []


def test_version():
    p = subprocess.run([sys.executable, "-m", "specstack.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"specstack {version('specstack')}\n", "")


@pytest.mark.parametrize("argv, phrase", [
    (("--warmup", "-1"), "--warmup must be >= 0, got -1"),
    (("--formats", "int3"), "formats must be among"),
    (("--tokens", "0,4"), "expected positive integers"),
    (("--hf-dtypes", "fp16"), "--hf-dtypes: transformers dtypes must be among bf16, fp32"),
    (("--model", "no-such-model"), "unknown model 'no-such-model'"),
])
def test_bench_forward_errors_follow_the_convention(run_cli, tmp_path, argv, phrase):
    r = run_cli("bench-forward", *argv, "--out", str(tmp_path / "f.json"))
    assert r.code == 2 and r.out == "", r.err
    assert r.err.startswith("specstack: error: ") and r.err.count("\n") == 1 and phrase in r.err, r.err
    assert not (tmp_path / "f.json").exists()


def test_bench_forward_writes_outside_docs_by_default():
    out = build_parser().parse_args(["bench-forward"]).out
    assert out == Path("bench_out/forward/forward.json")
