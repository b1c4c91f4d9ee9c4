"""Files in and out (issue 18, kinds 3, 6 and 8): every output is checked before the work starts,
written atomically (temp file + rename), and a damaged input or result file is one error line naming
the file (and the line), exit 2, no traceback, with every file that was there left byte-identical."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli_errors import CliResult, assert_error

import specstack.cli.generate
from specstack.errors import SpecstackError
from specstack.files import (
    atomic_output,
    atomic_write_text,
    check_writable_dir,
    check_writable_file,
    read_text,
)

PROC = Path("/proc")  # a pseudo file system: nothing can be created there, even by root
ROW = {"task_id": "a", "method": "ar", "repeat": 0, "new_tokens": 4, "seconds": 1.0, "tokens_per_s": 4.0}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root and its bytes (what a failed command must leave as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fails_untouched(root: Path, run: Callable[[], CliResult], phrase: str) -> CliResult:
    """run() fails as assert_error says, and leaves every file under root as it was (none added)."""
    before = snapshot(root)
    r = run()
    assert_error(r, phrase)
    assert snapshot(root) == before
    return r


@pytest.fixture
def no_generate_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("the model was loaded although an output cannot be written")

    monkeypatch.setattr(specstack.cli.generate, "load", fail)


def rows_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# ---------------------------------------------------------------------------------------------------
# The rules themselves (specstack/files.py)
# ---------------------------------------------------------------------------------------------------
def test_atomic_write_leaves_no_temp_file_and_a_plain_mode(tmp_path: Path):
    target = tmp_path / "out.json"
    atomic_write_text(target, "{}\n")
    assert target.read_text() == "{}\n" and os.listdir(tmp_path) == ["out.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() would make it, not mkstemp's 0o600


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path: Path):
    target = tmp_path / "summary.md"
    target.write_text("old")
    for error in (RuntimeError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(error)), atomic_output(target) as tmp:
            tmp.write_text("half")
            raise error
        assert target.read_text() == "old" and os.listdir(tmp_path) == ["summary.md"]


@pytest.mark.parametrize("case, phrase", [
    ("proc", "cannot write in /proc"),
    ("folder", "is a folder"),
    ("missing", "does not exist"),
    ("under a file", "does not exist"),
])
def test_check_writable_file(tmp_path: Path, case: str, phrase: str):
    (tmp_path / "f").write_text("x")
    path = {"proc": PROC / "x.html", "folder": tmp_path, "missing": tmp_path / "no" / "x.html",
            "under a file": tmp_path / "f" / "x.html"}[case]
    with pytest.raises(SpecstackError, match=phrase):
        check_writable_file(path, "--out")
    check_writable_file(tmp_path / "no" / "x.html", "--out", parents=True)  # a writer that creates folders
    assert sorted(os.listdir(tmp_path)) == ["f"]  # the probes leave nothing


def test_check_writable_dir(tmp_path: Path):
    (tmp_path / "f").write_text("x")
    check_writable_dir(tmp_path / "new" / "deeper", "--out")  # created later, under a writable folder
    assert sorted(os.listdir(tmp_path)) == ["f"]  # ... and not now
    with pytest.raises(SpecstackError, match="is a file, not a folder"):
        check_writable_dir(tmp_path / "f", "--out")
    with pytest.raises(SpecstackError, match="cannot write in /proc"):
        check_writable_dir(PROC / "run", "--out")


def test_read_text_names_the_first_bad_byte(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    with pytest.raises(SpecstackError, match=r"p.jsonl is not valid UTF-8 \(byte 0xe9 at offset 19, line 2\)"):
        read_text(path, "prompt file")


# ---------------------------------------------------------------------------------------------------
# Outputs checked before any model is loaded
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where, phrase", [("proc", "cannot write in /proc"), ("folder", "is a folder")])
def test_generate_html(run_cli, no_generate_load, tmp_path, where, phrase):
    path = PROC / "x.html" if where == "proc" else tmp_path
    r = fails_untouched(tmp_path, lambda: run_cli("generate", "--prompt", "hi", "--html", str(path)), phrase)
    assert f"--html {path}" in r.err


@pytest.fixture
def no_bench_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("the benchmark started although its output cannot be written")

    monkeypatch.setattr("specstack.bench.run.run_bench", fail)


@pytest.mark.parametrize("where, phrase", [("proc", "cannot write in /proc"), ("file", "is a file, not a folder")])
def test_bench_out_unwritable(run_cli, no_bench_run, tmp_path, where, phrase):
    (tmp_path / "file").write_text("results")
    out = PROC / "run" if where == "proc" else tmp_path / "file"
    fails_untouched(tmp_path, lambda: run_cli("bench", "--prompts", "humaneval", "--methods", "ar", "--out", str(out)),
                    phrase)


@pytest.mark.parametrize("where, phrase", [("proc", "cannot write in /proc"), ("folder", "is a folder")])
def test_bench_forward_out(run_cli, tmp_path, monkeypatch, where, phrase):
    monkeypatch.setattr("specstack.bench.forward.run_forward_bench", lambda *a: pytest.fail("the bench ran"))
    out = PROC / "f.json" if where == "proc" else tmp_path
    fails_untouched(tmp_path, lambda: run_cli("bench-forward", "--out", str(out)), phrase)


THROUGHPUT = ("throughput", "--target", "spire-67m", "--tau", "2", "--batch", "1", "--context", "512")


@pytest.mark.parametrize("flag", ["--plot", "--json"])
def test_throughput_outputs(run_cli, tmp_path, flag):
    fails_untouched(tmp_path, lambda: run_cli(*THROUGHPUT, flag, str(PROC / "x.png")), "cannot write in /proc")
    fails_untouched(tmp_path, lambda: run_cli(*THROUGHPUT, flag, str(tmp_path)), f"{flag} {tmp_path} is a folder")


def test_throughput_plot_writes_the_file_it_names(run_cli, tmp_path):
    """`--plot NAME` without .png wrote NAME.png and reported NAME: now what is reported is written."""
    plot = tmp_path / "heat"
    r = run_cli(*THROUGHPUT, "--plot", str(plot))
    assert r.code == 0, r.err
    assert f"heat-map written to {plot}\n" in r.err
    assert os.listdir(tmp_path) == ["heat"] and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_draft_out_unwritable(run_cli, tmp_path):
    fails_untouched(tmp_path, lambda: run_cli("train-draft", "--out", str(PROC / "run")), "cannot write in /proc")
    fails_untouched(tmp_path, lambda: run_cli("train-draft", "--out", str(tmp_path / "o"), "--sequences",
                                              str(tmp_path)), "--sequences")


def _sequences(path: Path, seq_len: int) -> Path:
    import torch

    from specstack.training.data import save_sequences

    save_sequences(path, torch.zeros(2, seq_len, dtype=torch.int32), torch.zeros(1, seq_len, dtype=torch.int32), {})
    return path


@pytest.fixture
def no_acceptance_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specstack.training.acceptance.measure_acceptance", lambda *a: pytest.fail("it ran"))


def test_draft_acceptance_json_and_short_sequences(run_cli, no_acceptance_run, tmp_path):
    seq = str(_sequences(tmp_path / "seq.safetensors", 16))
    before = snapshot(tmp_path)
    r = run_cli("draft-acceptance", "magicdec:8", "--sequences", seq, "--json", str(PROC / "a.json"))
    assert_error(r, "--json /proc/")
    # too short for the default contexts: magicdec sets its window per context, so nothing to measure
    assert_error(run_cli("draft-acceptance", "magicdec", "--sequences", seq),
                 f"the held-out sequences of {seq} hold 16 tokens, fewer than the smallest default context 256")
    assert_error(run_cli("draft-acceptance", "magicdec:8", "--sequences", seq, "--k", "16"),
                 "hold 16 tokens: a 16-chain needs more than 16")
    assert snapshot(tmp_path) == before


def test_draft_acceptance_table_without_contexts(run_cli, tmp_path, monkeypatch):
    """A fixed-window design on sequences shorter than every default context: the overall figure, in
    a well-formed table (no empty context column)."""
    from specstack.training.distill import Acceptance

    monkeypatch.setattr("specstack.training.acceptance.measure_acceptance",
                        lambda *a: {"magicdec:8": Acceptance([0.5, 0.25, 0.0, 0.0], {}, walk_tau=1.5)})
    r = run_cli("draft-acceptance", "magicdec:8", "--sequences", str(_sequences(tmp_path / "s.safetensors", 16)))
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[1:] == ["| design | overall | α overall |", "|---|---:|---|",
                         "| magicdec:8 | 1.625 (1.500) | 0.500, 0.250, 0.000, 0.000 |"]


# ---------------------------------------------------------------------------------------------------
# Damaged input and result files: the file and the line named, nothing changed
# ---------------------------------------------------------------------------------------------------
def test_bench_prompt_file_not_utf8(run_cli, no_bench_run, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"task_id": "a", "prompt": "x"}\n{"task_id": "b", "prompt": "caf\xe9"}\n')
    fails_untouched(tmp_path, lambda: run_cli("bench", "--prompts", str(prompts), "--methods", "ar", "--out",
                                              str(tmp_path / "o")), f"prompt file {prompts} is not valid UTF-8 (byte 0xe9 at offset 63, line 2)")


@pytest.mark.parametrize("line, phrase", [
    (b"{}", "results.jsonl:2: not a row of `specstack bench` (missing or malformed: task_id, method"),
    (b'{"task_id": "\xff"}', "results.jsonl is not valid UTF-8 (byte 0xff at offset"),
    (b"[1, 2]", "results.jsonl:2: not a row"),
    (b'{"task_id": "b", "me', "results.jsonl:2: not valid JSON"),
])
def test_bench_resume_on_damaged_rows(run_cli, no_bench_run, tmp_path, line, phrase):
    """A bad line that is not the last is an error before anything loads (a cut-off last line, the
    trace of an interrupted run, is dropped as before: tests/bench/test_bench.py)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.jsonl").write_bytes(rows_text([ROW]).encode() + line + b"\n" + rows_text([ROW]).encode())
    r = fails_untouched(tmp_path, lambda: run_cli("bench", "--prompts", "humaneval", "--methods", "ar", "--out",
                                                  str(out), "--resume"), phrase)
    assert str(out / "results.jsonl") in r.err


def _run_folder(tmp_path: Path, rows: list[dict], run: str | None = None) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.jsonl").write_text(rows_text(rows))
    if run is not None:
        (folder / "run.json").write_text(run)
    return folder


def test_ratios_of_methods_sharing_no_prompt(run_cli, tmp_path):
    folder = _run_folder(tmp_path, [ROW, ROW | {"task_id": "b", "method": "chain"}])
    fails_untouched(tmp_path, lambda: run_cli("bench", "--ratios", str(folder), "chain/ar"), f"--ratios 'chain/ar': chain and ar share no prompt with a speed > 0 in {folder}")


def test_phases_on_rows_without_phase_fields(run_cli, tmp_path):
    folder = _run_folder(tmp_path, [ROW, ROW | {"method": "chain", "phases": {"draft": 0.5}}])  # no forwards
    fails_untouched(tmp_path, lambda: run_cli("bench", "--phases", str(folder)),
                    f"--phases: no row of {folder} carries phase timings")


@pytest.mark.parametrize("run, phrase", [
    ('{"model": "m", "prompts": ', "run.json: not valid JSON"),
    ("[1]", "run.json: not the settings of a `specstack bench` run"),
    ('{"prompts": "humaneval"}', "run.json: the setting 'model' is missing"),
    (b'{"model": "\xff"}', "run.json is not valid UTF-8"),
])
def test_bench_ties_on_a_broken_run_json(run_cli, tmp_path, run, phrase):
    folder = _run_folder(tmp_path, [ROW])
    (folder / "run.json").write_bytes(run if isinstance(run, bytes) else run.encode())
    fails_untouched(tmp_path, lambda: run_cli("bench-ties", str(folder)), phrase)


def test_bench_ties_on_rows_without_token_ids(run_cli, tmp_path):
    """A published copy (docs/bench) keeps no per-token arrays: bench-ties cannot rerun its divergences."""
    rows = [ROW | {"dtype": "int4"}, ROW | {"method": "chain:k=2", "dtype": "int4", "identical_to_ar": False}]
    folder = _run_folder(tmp_path, rows, json.dumps({"model": "m", "prompts": "humaneval", "temperature": 0}))
    fails_untouched(tmp_path, lambda: run_cli("bench-ties", str(folder)),
                    "rows carry no token ids: run bench-ties on the bench_out folder of the run")


# ---------------------------------------------------------------------------------------------------
# A failed train-draft removes what it created, and only that
# ---------------------------------------------------------------------------------------------------
def _code(root: Path) -> Path:
    root.mkdir(parents=True)
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n\n\nclass C{i}:\n    pass\n")
    return root


@pytest.mark.parametrize("error, out_existed", [(SpecstackError("boom in training"), False), (KeyboardInterrupt(), True)],
                         ids=["error-new-out", "ctrl-c-old-out"])
def test_failed_train_draft_leaves_nothing_it_created(run_cli, tiny_model, tmp_path, monkeypatch, error, out_existed):
    """The teacher cache is built (OUT/teacher, OUT/train.log), then training fails before its first
    checkpoint: both go, OUT too when this run made it; what was in OUT before stays as it was."""
    work = tmp_path / "work"  # beside the converted-weights cache, which a run may add to
    code = _code(work / "code")
    out = work / "run"
    if out_existed:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = snapshot(work)
    seen = {}

    def fail(*_a, **_k):
        seen["teacher"] = (out / "teacher" / "train" / "meta.json").is_file()
        seen["log"] = (out / "train.log").is_file()
        raise error

    monkeypatch.setattr("specstack.training.distill.train", fail)
    r = run_cli("train-draft", "--target", tiny_model, "--data", f"code={code}:1", "--out", str(out),
                "--seq-len", "32", "--train-sequences", "4", "--heldout-sequences", "1", "--layers", "1",
                "--vocab", "64", "--no-online-teacher", "--device", "cpu")
    assert seen == {"teacher": True, "log": True}  # the run got as far as training
    if isinstance(error, KeyboardInterrupt):
        assert r.code == 130 and "Traceback" not in r.err
    else:
        assert r.code == 2 and r.err.splitlines()[-1] == "specstack: error: boom in training"
    assert snapshot(work) == before
    assert out.is_dir() == out_existed


GOOD_RUN = {"model": "m", "prompts": "humaneval", "methods": ["ar", "chain:k=2"], "dtype": "fp32",
            "max_new_tokens": 4, "temperature": 0, "draft": None, "draft_dtype": None}


@pytest.mark.parametrize("run, phrase", [
    (b'{"model": "m"}\xc1', "run.json is not valid UTF-8 (byte 0xc1 at offset 14"),
    (json.dumps({k: v for k, v in GOOD_RUN.items() if k != "model"}), "(missing or malformed: model)"),
    (json.dumps(GOOD_RUN | {"model": 1000000000}), "(missing or malformed: model)"),
    (json.dumps(GOOD_RUN | {"dtype": [1, "a"]}), "(missing or malformed: dtype)"),
    (json.dumps(GOOD_RUN | {"max_new_tokens": 0, "methods": [1]}), "(missing or malformed: methods, max_new_tokens)"),
])
def test_throughput_check_on_a_broken_run_json(run_cli, tmp_path, run, phrase):
    folder = _run_folder(tmp_path, [ROW])
    (folder / "run.json").write_bytes(run if isinstance(run, bytes) else run.encode())
    r = fails_untouched(tmp_path, lambda: run_cli("throughput-check", str(folder), "--hardware", "h100-fp8"), phrase)
    assert str(folder / "run.json") in r.err


def test_train_draft_sharegpt_data_that_is_not_utf8(run_cli, tiny_model, tmp_path):
    data = tmp_path / "sg.json"
    data.write_bytes(b'[{"id": "a", "conversations": [{"from": "human", "value": "x\x8d"}]}]')
    before = data.read_bytes()
    r = run_cli("train-draft", "--target", str(tiny_model), "--seq-len", "16", "--train-sequences", "2",
                "--heldout-sequences", "1", "--batch-size", "1", "--device", "cpu", "--out", str(tmp_path / "o"),
                "--data", f"sharegpt={data}:1")
    assert r.code == 2 and "Traceback" not in r.err  # the run's log lines come first, the error last
    assert r.err.splitlines()[-1] == (f"specstack: error: data file {data} is not valid UTF-8 "
                                      "(byte 0x8d at offset 60, line 1)")
    assert data.read_bytes() == before and not (tmp_path / "o").exists()


def test_a_prompt_that_is_not_valid_text(run_cli, tiny_model):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates."""
    assert_error(run_cli("generate", "--model", str(tiny_model), "--dtype", "fp32", "--max-new-tokens", "2",
                         "--prompt", "\udcff\udcfe"), "the prompt is not valid text: '\\udcff\\udcfe' at character 0")


@pytest.mark.parametrize("flag", ["--out", "--teacher", "--sequences"])
def test_train_draft_refuses_an_empty_path(run_cli, tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)  # where an empty path would have written
    argv = {"--out": str(tmp_path / "o")} | {flag: ""}
    fails_untouched(tmp_path, lambda: run_cli("train-draft", *[x for kv in argv.items() for x in kv]),
                    f"{flag}: the path is empty")


def test_train_draft_teacher_that_is_a_file(run_cli, tmp_path):
    teacher = tmp_path / "teacher-file"
    teacher.write_bytes(b"x")
    fails_untouched(tmp_path, lambda: run_cli("train-draft", "--out", str(tmp_path / "o"), "--teacher", str(teacher)),
                    f"--teacher {teacher} is a file, not a folder")
