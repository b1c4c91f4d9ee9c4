"""Corrupt files on the command line (issue 18, kind 4; unit/corrupt.py holds the valid files and the
damage): a corrupt model or draft ends in exit 2 with one error line and no traceback, in-process and
through the real entry point."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli.test_cli_errors import CliResult, assert_error
from unit.corrupt import hf_copy, tiny_gguf, with_byte_tokenizer

from specstack.cli.entry import main


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama, tmp_path_factory) -> Path:
    return with_byte_tokenizer(tiny_llama, tmp_path_factory.mktemp("with-tokenizer"))


@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_llama, tmp_path_factory) -> Path:
    return tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf"))


# ---------------------------------------------------------------------------------------------------
# The command line: exit 2, one error line, no traceback
# ---------------------------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> CliResult:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return CliResult(code, out, err)


GENERATE = ("generate", "--prompt", "x", "--max-new-tokens", "1", "--dtype", "fp32")


def test_cli_corrupt_model(capsys, tiny_llama, tiny_gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    d = hf_copy(tiny_llama.path, tmp_path / "cut")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    assert_error(cli(capsys, *GENERATE, "--model", str(d)), f"model.safetensors in {d}")
    z = hf_copy(tiny_llama.path, tmp_path / "zero")
    (z / "config.json").write_text(json.dumps({**json.loads((z / "config.json").read_text()), "num_attention_heads": 0}))
    assert_error(cli(capsys, *GENERATE, "--model", str(z)), "num_attention_heads must be >= 1, got 0")
    g = tmp_path / "cut.gguf"
    g.write_bytes(tiny_gguf_file.read_bytes()[:300])
    assert_error(cli(capsys, *GENERATE, "--model", str(g)), str(g))


def test_cli_corrupt_draft(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "draft.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    r = cli(capsys, *GENERATE, "--model", str(tiny_model_dir), "--method", "chain:k=2", "--draft", str(bad))
    assert_error(r, f"draft file {bad}: not a readable safetensors file")
    other = tmp_path / "weights.safetensors"
    shutil.copy(tiny_model_dir / "model.safetensors", other)
    (tmp_path / "seq.safetensors").write_bytes(b"never read: the draft is checked first")
    r = cli(capsys, "draft-acceptance", str(other), "--sequences", str(tmp_path / "seq.safetensors"))
    assert_error(r, "without specstack's draft metadata")


def test_real_entry_point_on_a_corrupt_model(tiny_llama, tmp_path):
    d = hf_copy(tiny_llama.path, tmp_path / "m")
    (d / "config.json").write_text("[]")
    p = subprocess.run([sys.executable, "-m", "specstack.cli", *GENERATE, "--model", str(d)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SPECSTACK_CACHE": str(tmp_path / "c")})
    assert_error(CliResult(p.returncode, p.stdout, p.stderr), f"config.json in {d}: not a JSON object")
