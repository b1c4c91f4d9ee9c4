"""Fixtures for the CLI tests: an in-process runner and a tiny random Llama checkpoint.

The tiny checkpoint is a real Hugging Face directory (config.json + safetensors + tokenizer files):
random weights with the default model's tokenizer (copied from the embedded GGUF, offline), a small
hidden size and a 64-token context, so a whole `specstack generate` runs in a fraction of a second and
"prompt longer than the context" is cheap to provoke.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_checkpoints import TINY_CONTEXT, build_tiny_checkpoint

import specstack
import specstack.models.loading
from specstack.cli.entry import main

# a speculative run adds tau; the last line names the method (`auto` says what it ran), a batch's per-row lines do not
STATS_LINE = re.compile(r"^\d+ tokens in \d+\.\d+ s \(\d+\.\d+ tokens/s; prefill \d+ tokens \d+\.\d+ s\)"
                        r"(; tau \d+\.\d+ tokens/forward over \d+ target forwards)?(; method \S.*)?$")


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def tiny_context() -> int:
    return TINY_CONTEXT


@pytest.fixture
def stats_line() -> re.Pattern[str]:
    """The stats line `specstack generate` prints last on stderr (RunStats.line())."""
    return STATS_LINE


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `specstack ARGS...` in-process; returns exit code, stdout and stderr."""

    def run(*argv: str) -> CliResult:
        capsys.readouterr()  # drop anything printed before
        code = main(list(argv))
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def tiny_model(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny checkpoint's path, with specstack's converted-weights cache kept inside tmp_path."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "specstack-cache"))
    return str(tiny_model_dir)


def fail(*_a, **_k):
    raise AssertionError("a model was loaded although the arguments are invalid")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model fails wherever it is called from. Every specstack module is imported first and
    patched where it bound the name: a module first imported while the patch is on would otherwise
    keep the failing stand-in for the rest of the session."""
    real = specstack.models.loading.load_model
    for info in pkgutil.walk_packages(specstack.__path__, "specstack."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name.startswith("specstack") and getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", fail)
