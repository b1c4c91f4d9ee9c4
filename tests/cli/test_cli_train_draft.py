"""`specstack train-draft` end to end on the real default model (a few files of Python, a handful
of steps): the draft file it writes loads as `--draft` and speculative output stays the target's
greedy output; bad arguments fail with one line before any model is read."""
from __future__ import annotations

import json

import pytest
from cli.test_cli_errors import assert_error

import specstack.models.loading

TRAIN = ("train-draft", "--out")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("a model was loaded although the arguments are invalid")

    monkeypatch.setattr(specstack.models.loading, "load_model", fail)


@pytest.mark.parametrize("extra,phrase", [
    (("--data", "novels:1"), "unknown source 'novels'"),
    (("--data", "code:0"), "weight of code must be > 0"),
    (("--data", "code:x"), "must be a number"),
    (("--data", "code=/nonexistent/dir:1"), "does not exist"),
    (("--steps", "0"), "--steps must be >= 1"),
    (("--omega", "1.5"), "--omega must be in [0, 1]"),
    (("--vocab", "-1"), "--vocab and --window must be >= 0"),
    (("--recipe", "medusa"), "invalid choice: 'medusa'"),
], ids=["source", "weight0", "weight-nan", "missing-dir", "steps", "omega", "vocab", "recipe"])
def test_bad_arguments_fail_before_loading(run_cli, no_model, tmp_path, extra, phrase):
    assert_error(run_cli(*TRAIN, str(tmp_path / "o"), *extra), phrase)


def test_cuda_without_a_gpu(run_cli, no_model, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert_error(run_cli(*TRAIN, str(tmp_path / "o"), "--device", "cuda"), "no CUDA device")
    assert not (tmp_path / "o").exists()  # nothing written


def test_out_is_a_file(run_cli, no_model, tmp_path):
    (tmp_path / "f").write_text("x")
    assert_error(run_cli(*TRAIN, str(tmp_path / "f")), "is a file")


def test_train_a_tiny_draft_and_generate_with_it(run_cli, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    for i in range(60):  # distinct little modules: about 1 in 20 is held out (by name)
        (code / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n\nclass C{i}:\n"
                                       f"    def g(self, y):\n        return [y] * {i}\n")
    out = tmp_path / "run"
    r = run_cli("train-draft", "--data", f"code={code}:1", "--out", str(out), "--steps", "3", "--seq-len", "64",
                "--train-sequences", "8", "--heldout-sequences", "1", "--vocab", "512", "--batch-size", "2",
                "--eval-every", "3")
    assert r.code == 0, r.err
    draft = out / "draft.safetensors"
    assert draft.is_file() and draft.stat().st_size < 25 * 2**20
    acc = json.loads((out / "acceptance.json").read_text())
    assert len(acc["alpha"]) == 4 and acc["tau"] >= 1.0
    assert "train-draft" in (out / "train.log").read_text()
    prompt = ("generate", "--prompt", "def add(a, b):\n", "--max-new-tokens", "16", "--dtype", "fp32")
    ar = run_cli(*prompt)
    assert ar.code == 0, ar.err
    spec = run_cli(*prompt, "--method", "chain:k=3", "--draft", str(draft), "--draft-dtype", "fp32")
    assert spec.code == 0, spec.err
    assert spec.out == ar.out


def test_missing_draft_file(run_cli, tmp_path):
    r = run_cli("generate", "--prompt", "hi", "--method", "chain", "--draft", str(tmp_path / "nope.safetensors"))
    assert_error(r, "draft file not found")
