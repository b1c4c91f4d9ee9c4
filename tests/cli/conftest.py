"""Fixtures for the CLI tests: an in-process runner and a tiny random Llama checkpoint.

The tiny checkpoint is a real Hugging Face directory (config.json + safetensors + tokenizer files):
random weights with the default model's tokenizer (copied from the embedded GGUF, offline), a small
hidden size and a 64-token context, so a whole `specstack generate` runs in a fraction of a second and
"prompt longer than the context" is cheap to provoke.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from specstack.cli import main

TINY_CONTEXT = 64
STATS_LINE = re.compile(r"^\d+ tokens in \d+\.\d+ s \(\d+\.\d+ tokens/s; prefill \d+ tokens \d+\.\d+ s\)$")


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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture
def tiny_model(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny checkpoint's path, with specstack's converted-weights cache kept inside tmp_path."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "specstack-cache"))
    return str(tiny_model_dir)
