"""`specstack train-draft` end to end on the real default model (a few files of Python, a handful
of steps): the draft file it writes loads as `--draft` and speculative output stays the target's
greedy output; bad arguments fail with one line before any model is read."""
from __future__ import annotations

import json

import pytest
from cli.test_cli_errors import assert_error

TRAIN = ("train-draft", "--out")




@pytest.mark.parametrize("extra,phrase", [
    (("--data", "novels:1"), "unknown source 'novels'"),
    (("--data", "code:0"), "weight of code must be > 0"),
    (("--data", "code:x"), "must be a number"),
    (("--data", "code=/nonexistent/dir:1"), "does not exist"),
    (("--steps", "0"), "--steps must be >= 1"),
    (("--omega", "1.5"), "--omega must be in [0, 1]"),
    (("--vocab", "-1"), "--vocab must be >= 0, got -1"),
    (("--recipe", "medusa"), "invalid choice: 'medusa'"),
    (("--prepare-only",), "--prepare-only needs --sequences FILE"),
    (("--contexts", "256,x"), "--contexts must be comma-separated integers"),
    (("--contexts", "1024", "--seq-len", "512"), "each must lie in [2, --seq-len 512]"),
], ids=["source", "weight0", "weight-nan", "missing-dir", "steps", "omega", "vocab", "recipe", "prepare-only",
        "contexts-nan", "contexts-long"])
def test_bad_arguments_fail_before_loading(run_cli, no_model, tmp_path, extra, phrase):
    assert_error(run_cli(*TRAIN, str(tmp_path / "o"), *extra), phrase)


def test_cuda_without_a_gpu(run_cli, no_model, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert_error(run_cli(*TRAIN, str(tmp_path / "o"), "--device", "cuda"), "no CUDA device")
    assert not (tmp_path / "o").exists()  # nothing written


def test_out_is_a_file(run_cli, no_model, tmp_path):
    (tmp_path / "f").write_text("x")
    assert_error(run_cli(*TRAIN, str(tmp_path / "f")), "is a file")


def _code_corpus(root):
    root.mkdir()
    for i in range(60):  # distinct little modules: about 1 in 20 is held out (by name)
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n\nclass C{i}:\n"
                                       f"    def g(self, y):\n        return [y] * {i}\n")
    return root


def test_train_a_tiny_draft_and_generate_with_it(run_cli, tmp_path):
    code = _code_corpus(tmp_path / "code")
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


def test_prepared_sequences_online_teacher_and_acceptance_by_context(run_cli, tmp_path):
    """The GPU recipe on CPU: sequences prepared once (--prepare-only), then read back without the text;
    the teacher run on each batch; held-out acceptance by context, and `draft-acceptance` on the same
    held-out sequences for the draft and MagicDec."""
    import shutil

    code = _code_corpus(tmp_path / "code")
    seq = tmp_path / "seq.safetensors"
    shape = ("--seq-len", "64", "--train-sequences", "8", "--heldout-sequences", "2")
    r = run_cli("train-draft", "--data", f"code={code}:1", "--out", str(tmp_path / "prep"), "--sequences", str(seq),
                "--prepare-only", *shape)
    assert r.code == 0, r.err
    assert seq.is_file() and not (tmp_path / "prep" / "draft.safetensors").exists()
    shutil.rmtree(code)  # from now on the text is gone: only the prepared file can feed the run
    out = tmp_path / "run"
    r = run_cli("train-draft", "--sequences", str(seq), "--out", str(out), "--online-teacher", "--contexts", "32,64",
                "--steps", "2", "--vocab", "512", "--batch-size", "2", "--eval-every", "2", *shape)
    assert r.code == 0, r.err
    acc = json.loads((out / "acceptance.json").read_text())
    assert acc["online_teacher"] is True and not (out / "teacher").exists()  # nothing cached to disk
    assert set(acc["by_context"]) == {"32", "64"} and all(len(a["alpha"]) == 4 for a in acc["by_context"].values())
    report = tmp_path / "acc.json"
    r = run_cli("draft-acceptance", "--sequences", str(seq), "--contexts", "32,64", "--json", str(report),
                str(out / "draft.safetensors"), "magicdec", "magicdec:128", "smollm2-135m")
    assert r.code == 0, r.err
    got = json.loads(report.read_text())
    assert got["smollm2-135m"]["tau"] > 4.5  # a model design: the target drafting for itself, full context
    assert got[str(out / "draft.safetensors")]["tau"] >= 1.0
    assert "alpha" in got["magicdec"] and got["magicdec"]["alpha"] == []  # one window per context: no overall
    # a window wider than the text is the target itself: every chain accepted (up to bf16 near-ties)
    assert got["magicdec:128"]["tau"] > 4.5 and "magicdec:128" in r.out


@pytest.mark.parametrize("extra,phrase", [
    (("magicdec",), "sequences file not found"),
    (("novel-draft", "--sequences", "SEQ"), "neither a draft file"),
    (("magicdec:0", "--sequences", "SEQ"), "the window must be a positive integer"),
    (("magicdec", "--sequences", "SEQ", "--contexts", "4096"), "each must lie in [2, --seq-len 16]"),
    (("magicdec", "--sequences", "SEQ", "--k", "0"), "--k and --heldout-sequences must be >= 1"),
], ids=["missing-file", "unknown-design", "window", "context", "k"])
def test_draft_acceptance_bad_arguments(run_cli, no_model, tmp_path, extra, phrase):
    import torch

    from specstack.training.data import save_sequences

    seq = tmp_path / "seq.safetensors"
    save_sequences(seq, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(1, 16, dtype=torch.int32), {})
    args = [str(seq) if a == "SEQ" else a for a in extra]
    if "--sequences" not in args:
        args += ["--sequences", str(tmp_path / "missing.safetensors")]
    assert_error(run_cli("draft-acceptance", *args), phrase)
