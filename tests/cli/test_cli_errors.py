"""Bad input -> exit code 2 and exactly one line `specstack: error: ...` on stderr, never a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import specstack.cli.generate
from specstack.models.registry import DEFAULT_MODEL


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def assert_error(r: CliResult, phrase: str) -> None:
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err
    assert r.err.endswith("\n") and r.err.count("\n") == 1, f"expected one line, got {r.err!r}"
    assert r.err.startswith("specstack: error: "), r.err
    assert phrase.lower() in r.err.lower(), f"{phrase!r} not in {r.err!r}"
    assert r.out == ""


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cheap checks must fail before any weights are read."""

    def fail(*_a, **_k):
        raise AssertionError("the model was loaded although the arguments are invalid")

    monkeypatch.setattr(specstack.cli.generate, "load", fail)


def _file(tmp_path: Path, data: bytes, name: str = "prompt.txt") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


GEN = ("generate", "--prompt", "hi")

CHEAP_CASES = {
    "unknown model": (("generate", "--model", "no-such-model", "--prompt", "hi"), "unknown model 'no-such-model'"),
    "missing gguf": (("generate", "--model", "/nonexistent/m.gguf", "--prompt", "hi"), "GGUF file not found"),
    "missing model dir": (("generate", "--model", "/nonexistent/ckpt", "--prompt", "hi"), "model path not found"),
    "relative missing dir": (("generate", "--model", "./nope", "--prompt", "hi"), "model path not found"),
    "empty prompt": (("generate", "--prompt", ""), "prompt is empty"),
    "whitespace prompt": (("generate", "--prompt", " \n\t "), "prompt is empty"),
    "max_new_tokens 0": ((*GEN, "--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
    "max_new_tokens < 0": ((*GEN, "--max-new-tokens", "-3"), "--max-new-tokens must be >= 1, got -3"),
    "max_new_tokens not int": ((*GEN, "--max-new-tokens", "ten"), "--max-new-tokens must be an integer, got 'ten'"),
    "temperature < 0": ((*GEN, "--temperature", "-0.5"), "--temperature must be >= 0, got -0.5"),
    "temperature nan": ((*GEN, "--temperature", "nan"), "--temperature must be a finite number"),
    "top_p 0": ((*GEN, "--top-p", "0"), "--top-p must be in (0, 1], got 0"),
    "top_p > 1": ((*GEN, "--top-p", "1.5"), "--top-p must be in (0, 1], got 1.5"),
    "top_k < 0": ((*GEN, "--top-k", "-1"), "--top-k must be >= 0, got -1"),
    "dtype": ((*GEN, "--dtype", "fp16"), "invalid choice: 'fp16'"),
    "device": ((*GEN, "--device", "tpu"), "invalid choice: 'tpu'"),
    "threads 0": ((*GEN, "--threads", "0"), "--threads must be >= 1, got 0"),
    "no prompt": (("generate",), "one of the arguments --prompt --prompt-file is required"),
    "prompt and file": ((*GEN, "--prompt-file", "x.txt"), "not allowed with argument"),
    "unknown flag": ((*GEN, "--bogus"), "unrecognized arguments: --bogus"),
    "no command": ((), "required: COMMAND"),
    "unknown command": (("frobnicate",), "invalid choice: 'frobnicate'"),
    "suffix with chat": ((*GEN, "--suffix", "x", "--chat"), "--suffix and --chat do not go together"),
    "suffix with n": ((*GEN, "--suffix", "x", "--n", "2"), "--suffix fills one middle"),
    "extra file alone": ((*GEN, "--extra-file", "x.py"), "add --suffix or --suffix-file"),
    "suffix and file": ((*GEN, "--suffix", "x", "--suffix-file", "y"), "not allowed with argument"),
}


@pytest.mark.parametrize("argv,phrase", CHEAP_CASES.values(), ids=CHEAP_CASES.keys())
def test_cheap_errors_fail_before_loading(run_cli, no_loading, argv, phrase):
    assert_error(run_cli(*argv), phrase)


def test_prompt_file_missing(run_cli, no_loading, tmp_path):
    assert_error(run_cli("generate", "--prompt-file", str(tmp_path / "nope.txt")), "prompt file not found")


def test_prompt_file_is_directory(run_cli, no_loading, tmp_path):
    assert_error(run_cli("generate", "--prompt-file", str(tmp_path)), "is a directory")


def test_prompt_file_not_utf8(run_cli, no_loading, tmp_path):
    path = _file(tmp_path, "def f():\n    return 'caf\u00e9'\n".encode("latin-1"))
    assert_error(run_cli("generate", "--prompt-file", path), "is not valid UTF-8 (byte 0xe9")


def test_prompt_file_empty(run_cli, no_loading, tmp_path):
    assert_error(run_cli("generate", "--prompt-file", _file(tmp_path, b"  \n\n")), "is empty")


def test_cuda_without_cuda(run_cli, no_loading, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_error(run_cli(*GEN, "--device", "cuda"), "no CUDA device is available")


def test_prompt_longer_than_context(run_cli, tiny_model, tiny_context, tmp_path):
    path = _file(tmp_path, ("hello world " * tiny_context).encode())
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", path, "--dtype", "fp32")
    assert_error(r, f"over the model's context limit of {tiny_context}")


def test_int4_needs_aligned_dims(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    # int4 groups 32 inputs: a d_ff of 112 (down projection with 112 inputs) cannot be packed
    import shutil

    bad = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, bad)
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 112
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run_cli("generate", "--model", str(bad), "--prompt", "hi", "--dtype", "int4")
    assert_error(r, "int4")


def test_corrupt_config(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, bad)
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    (bad / "config.json").write_text("{not json")
    # fp32, as its siblings: the default format would first build the kernels in this empty cache, with a line each
    assert_error(run_cli("generate", "--model", str(bad), "--prompt", "hi", "--dtype", "fp32"), "cannot load")


def test_checkpoint_without_tokenizer(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / f, bare / f)
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    r = run_cli("generate", "--model", str(bare), "--prompt", "hi", "--dtype", "fp32")
    assert_error(r, "has no tokenizer")


def test_keyboard_interrupt_exits_130_quietly(run_cli, monkeypatch):
    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(specstack.cli.generate, "load", interrupt)
    r = run_cli(*GEN)
    assert (r.code, r.err) == (130, "")


@pytest.mark.parametrize("argv,phrase", [
    (("generate", "--model", "no-such-model", "--prompt", "hi"), "unknown model"),
    (("generate", "--model", DEFAULT_MODEL, "--prompt", "hi", "--dtype", "fp16"), "invalid choice"),
], ids=["unknown-model", "bad-choice"])
def test_real_entry_point_exits_2(argv, phrase):
    p = subprocess.run([sys.executable, "-m", "specstack.cli", *argv], capture_output=True, text=True, timeout=120)
    assert_error(CliResult(p.returncode, p.stdout, p.stderr), phrase)


def test_suffix_file_missing(run_cli, no_loading, tmp_path):
    assert_error(run_cli(*GEN, "--suffix-file", str(tmp_path / "after.py")), "suffix file not found")


def test_suffix_on_a_model_without_fim_tokens(run_cli):
    """The default model has no FIM tokens: refused by name once its tokenizer is read."""
    assert_error(run_cli("generate", "--model", DEFAULT_MODEL, "--prompt", "def f(", "--suffix", "):\n"),
                 "has no fill-in-the-middle tokens")
