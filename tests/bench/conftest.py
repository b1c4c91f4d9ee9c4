"""Fixtures of the `specstack bench` tests: each module provides `tiny_dir` (tests/bench/tiny_bench.py's
checkpoint with its own prompts); these turn it into command-line arguments and run the command."""
from __future__ import annotations

from pathlib import Path

import pytest

from specstack.cli.entry import main


@pytest.fixture
def tiny(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """--model and --prompts for the module's tiny checkpoint (converted weights cached per module)."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tiny_dir.parent / "specstack-cache"))
    return ["--model", str(tiny_dir), "--prompts", str(tiny_dir.parent / "prompts.jsonl")]


def _runner(capsys: pytest.CaptureFixture[str], command: str):
    """Run `specstack COMMAND ARGS...` in-process: (exit code, stdout, stderr)."""

    def go(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([command, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return go


@pytest.fixture
def bench(capsys: pytest.CaptureFixture[str]):
    return _runner(capsys, "bench")


@pytest.fixture
def bench_forward(capsys: pytest.CaptureFixture[str]):
    return _runner(capsys, "bench-forward")
