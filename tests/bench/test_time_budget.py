"""`specstack bench --time-budget` (BASS's pass@first / pass@all under a time budget): the sandboxed
HumanEval executor (a correct completion passes, a wrong one fails, an endless loop times out, writes
outside its folder, memory hunger, new processes and early exits are contained, our environment is
not inherited), the scores by hand (first-finisher semantics, ties, nothing finished), a tiny-model run
end to end, and bad flags (one line, exit 2, nothing loaded)."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from bench.tiny_bench import save_tiny_bench_model

from specstack.bench.datasets import humaneval_path
from specstack.bench.humaneval_exec import check_completion, check_many, load_problems
from specstack.bench.pass_at_budget import Outcome, first_finisher, pass_at_all, pass_at_first, summarize, turn_on
from specstack.bench.time_budget import HUMANEVAL_STOP, TimeBudgetSettings, sample_gens, warmup_gens
from specstack.validate import MAX_BATCH_SIZE


# ---------------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problem():
    return load_problems()["HumanEval/0"]


@pytest.fixture(scope="module")
def canonical() -> str:
    """HumanEval/0's canonical solution: only to show that a correct completion passes."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return next(json.loads(line)["canonical_solution"] for line in f if '"HumanEval/0"' in line)


def test_correct_completion_passes(problem, canonical):
    r = check_completion(problem, canonical)
    assert r.passed and r.status == "passed" and r.output == ""


def test_wrong_completion_fails_with_its_traceback(problem):
    r = check_completion(problem, "    return False\n")
    assert not r.passed and r.status == "failed"
    assert "AssertionError" in r.output and "program.py" in r.output


def test_endless_loop_times_out(problem):
    r = check_completion(problem, "    while True:\n        pass\n", timeout=1.0)
    assert r.status == "timeout" and not r.passed


def test_exit_before_the_tests_is_no_pass(problem):
    for early in ("    import sys\n    sys.exit(0)\n", "    import os\n    os._exit(0)\n"):
        r = check_completion(problem, early)
        assert r.status == "failed", early


def test_writes_outside_the_sandbox_are_refused(problem, canonical, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    attempts = [f"    open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')\n",
                f"    import os\n    os.remove({str(victim)!r})\n",
                f"    import os\n    os.rename({str(victim)!r}, 'moved.txt')\n",
                f"    import os\n    os.chdir({str(tmp_path)!r})\n    open('relative.txt', 'w')\n",
                f"    import os\n    os.system('touch {tmp_path / 'spawned.txt'}')\n",
                f"    import subprocess\n    subprocess.run(['touch', {str(tmp_path / 'spawned.txt')!r}])\n"]
    for code in attempts:
        r = check_completion(problem, code + canonical)
        assert r.status == "failed" and "sandbox" in r.output, (code, r.output)
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
    # inside its own folder a program may write and remove files
    inside = "    open('scratch.txt', 'w').write('x')\n    import os\n    os.remove('scratch.txt')\n"
    assert check_completion(problem, inside + canonical).passed


def test_memory_hunger_is_contained(problem):
    r = check_completion(problem, "    hog = bytearray(1 << 36)\n", memory=512 << 20)
    assert r.status == "failed" and "MemoryError" in r.output


def test_our_environment_is_not_inherited(problem, canonical, monkeypatch):
    monkeypatch.setenv("SPECSTACK_TEST_SECRET", "hunter2")
    probe = "    import os\n    assert 'SPECSTACK_TEST_SECRET' not in os.environ, 'leaked'\n"
    assert check_completion(problem, probe + canonical).passed


def test_check_many_keeps_order_and_runs_equal_jobs_once(problem, canonical):
    jobs = [(problem, canonical), (problem, "    return False\n"), (problem, canonical)]
    assert [r.status for r in check_many(jobs, workers=2)] == ["passed", "failed", "passed"]


# ---------------------------------------------------------------------------------------------------
# Scores by hand
# ---------------------------------------------------------------------------------------------------
def test_first_finisher_semantics():
    outs = [Outcome(0, 3.0, True), Outcome(1, 1.0, False), Outcome(2, 2.0, True)]
    # (budget, pass@first, pass@all)
    for budget, first, any_ in [(0.5, False, False), (1.0, False, False), (1.9, False, False), (2.0, False, True),
                                (3.0, False, True), (math.inf, False, True)]:
        assert pass_at_first(outs, budget) is first and pass_at_all(outs, budget) is any_, budget
    assert first_finisher(outs, 0.5) is None and first_finisher(outs, 5).sample == 1
    assert turn_on(outs) == (None, 2.0)
    good_first = [Outcome(0, 2.0, False), Outcome(1, 1.5, True)]
    assert [pass_at_first(good_first, b) for b in (1.0, 1.5, 2.0)] == [False, True, True]
    assert turn_on(good_first) == (1.5, 1.5)


def test_ties_go_to_the_lowest_sample_index():
    for outs in ([Outcome(0, 1.0, False), Outcome(1, 1.0, True)], [Outcome(1, 1.0, True), Outcome(0, 1.0, False)]):
        assert first_finisher(outs).sample == 0
        assert not pass_at_first(outs, 1.0) and pass_at_all(outs, 1.0)
    assert pass_at_first([Outcome(2, 1.0, True), Outcome(3, 1.0, False)], 1.0)


def test_nothing_finished_fails_at_every_budget():
    outs = [Outcome(0, None, True), Outcome(1, None, True)]
    assert not pass_at_first(outs, math.inf) and not pass_at_all(outs, math.inf)
    assert turn_on(outs) == (None, None)
    assert not pass_at_first([], 10.0) and not pass_at_all([], 10.0)


def _row(task: str, method: str, sample: int, t: float | None, passed: bool, wall: float = 4.0) -> dict:
    return {"task_id": task, "method": method, "sample": sample, "finish_seconds": t, "passed": passed,
            "new_tokens": 10, "batch_seconds": wall, "finish_reason": "stop", "tau": None}


def test_summary_by_hand():
    rows = [_row("p1", "ar", 0, 2.0, True), _row("p1", "ar", 1, 3.0, False),  # first passes at 2
            _row("p2", "ar", 0, 1.0, False), _row("p2", "ar", 1, 4.0, True),  # first fails; all at 4
            _row("p1", "ngram", 0, 1.0, True), _row("p1", "ngram", 1, 1.0, False),  # tie: sample 0 passes
            _row("p2", "ngram", 0, None, True), _row("p2", "ngram", 1, None, True, wall=2.0)]  # nothing finished
    doc = summarize(rows, [1.0, 2.0, 4.0], ["ngram", "ar"])
    ar, ng = doc["methods"]["ar"], doc["methods"]["ngram"]
    assert list(doc["methods"]) == ["ngram", "ar"]
    assert ar["pass_at_first"] == {"1": 0.0, "2": 0.5, "4": 0.5}
    assert ar["pass_at_all"] == {"1": 0.0, "2": 0.5, "4": 1.0}
    assert ng["pass_at_first"] == ng["pass_at_all"] == {"1": 0.5, "2": 0.5, "4": 0.5}
    assert (ar["pass_at_first_unbounded"], ar["pass_at_all_unbounded"]) == (0.5, 1.0)
    assert ar["tokens_per_s"] == pytest.approx(40 / 8.0) and ar["median_finish_seconds"] == 2.5
    assert ar["median_first_finish_seconds"] == 1.5 and ar["sample_pass_rate"] == 0.5
    assert doc["problems"]["p2"]["ar"] == {"samples": 2, "samples_passed": 1, "first_finish_seconds": 1.0,
                                           "first_sample": 0, "pass_at_first": {"1": False, "2": False, "4": False},
                                           "pass_at_all": {"1": False, "2": False, "4": True}}
    assert doc["problems"]["p2"]["ngram"]["first_finish_seconds"] is None
    curve = doc["curve"]
    grid = curve["budgets"]
    assert grid == sorted(grid) and {1.0, 2.0, 3.0, 4.0} <= set(grid) and grid[-1] > 4.0
    for name, c in curve["methods"].items():  # the curve agrees with the given budgets, never falls
        for key in ("pass_at_first", "pass_at_all"):
            assert all(a <= b for a, b in zip(c[key], c[key][1:], strict=False))
            for b, v in doc["methods"][name][key].items():
                assert c[key][grid.index(float(b))] == v


def _settings(n: int, seed: int | None) -> TimeBudgetSettings:
    return TimeBudgetSettings(model="m", limit=None, methods=("ar",), n=n, budgets=(1.0,), max_new_tokens=64,
                              temperature=0.8, top_k=0, top_p=1.0, seed=seed, dtype="fp32", device="cpu", draft=None,
                              draft_dtype=None, ngram=None, threads=None)


def test_samples_are_seeded_in_turn_and_stop_like_humaneval():
    gens = sample_gens(_settings(3, 10))
    assert [g.sampling.seed for g in gens] == [10, 11, 12]
    assert all(g.stop_strings == HUMANEVAL_STOP and g.stop_on_eos and g.max_new_tokens == 64 for g in gens)
    assert [g.sampling.seed for g in sample_gens(_settings(2, None))] == [None, None]


def test_warmup_rows_end_one_after_another():
    """The warm-up batch shrinks through every row count, n down to 1, before anything is timed."""
    for n in (1, 2, 5, 8):
        lengths = [g.max_new_tokens for g in warmup_gens(_settings(n, 0))]
        assert lengths == sorted(set(lengths)) and len(lengths) == n and lengths[-1] == 16


# ---------------------------------------------------------------------------------------------------
# End to end on a tiny model
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/bench/tiny_bench.py's checkpoint, with a context that holds HumanEval's prompts (RoPE: the
    weights do not depend on it)."""
    path = save_tiny_bench_model(tmp_path_factory.mktemp("tiny-time-budget") / "model", [])
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 512
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def tiny_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("SPECSTACK_CACHE", str(tiny_dir.parent / "specstack-cache"))
    return ["--model", str(tiny_dir)]


def test_time_budget_end_to_end(tiny_model, bench, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = bench(*tiny_model, "--prompts", "humaneval", "--limit", "2", "--n", "2",
                              "--time-budget", "100,1", "--methods", "ar;chain:k=2", "--dtype", "fp32",
                              "--draft-dtype", "fp32", "--max-new-tokens", "6", "--threads", "1",
                              "--temperature", "0.8", "--seed", "3", "--out", str(out))
    assert code == 0, err
    assert "pass@first 1 s" in stdout
    assert (out / "pass_at_budget.png").stat().st_size > 0
    assert (out / "time_budget.md").read_text().startswith("# pass@first / pass@all under a time budget")
    doc = json.loads((out / "time_budget.json").read_text())
    assert doc["settings"]["n"] == 2 and doc["settings"]["budgets"] == [1.0, 100.0]
    summary = doc["summary"]
    assert list(summary["methods"]) == ["ar", "chain:k=2"]
    assert set(summary["problems"]) == {"HumanEval/0", "HumanEval/1"}
    for m in summary["methods"].values():
        assert set(m["pass_at_first"]) == set(m["pass_at_all"]) == {"1", "100"}
        assert m["problems"] == 2 and m["samples"] == 4 and m["tokens_per_s"] > 0
        assert m["median_finish_seconds"] > 0
    assert {1.0, 100.0} <= set(summary["curve"]["budgets"])

    rows = [json.loads(line) for line in (out / "time_budget_rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2
    assert sorted((r["task_id"], r["method"], r["sample"], r["seed"]) for r in rows) == sorted(
        (t, m, i, 3 + i) for t in ("HumanEval/0", "HumanEval/1") for m in ("ar", "chain:k=2") for i in range(2))
    for r in rows:
        assert 0 < r["finish_seconds"] <= r["batch_seconds"]
        assert 0 <= r["new_tokens"] <= 6 and r["finish_reason"] in ("eos", "stop", "length")
        assert (r["result"] is None) == r["passed"]
        assert not any(s in r["completion"] for s in HUMANEVAL_STOP)
        if r["finish_reason"] == "length":
            assert r["new_tokens"] == 6
    # the summary is the rows' scores
    again = summarize(rows, [1.0, 100.0], ["ar", "chain:k=2"])
    assert again["methods"] == summary["methods"]


# ---------------------------------------------------------------------------------------------------
# Bad flags: one line, exit 2, before any model is loaded
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--time-budget", "0"], "--time-budget must be > 0, got 0"),
    (["--time-budget", "-2"], "--time-budget must be > 0"),
    (["--time-budget", "nan"], "--time-budget must be a finite number"),
    (["--time-budget", "1,inf"], "--time-budget must be a finite number"),
    (["--time-budget", "x"], "--time-budget must be a number"),
    (["--time-budget", ""], "--time-budget needs at least one budget"),
    (["--time-budget", "1,,2"], "--time-budget must be comma-separated seconds"),
    (["--time-budget", "1", "--n", "0"], "--n must be >= 1"),
    (["--time-budget", "1", "--n", str(MAX_BATCH_SIZE + 1)], f"--n must be <= {MAX_BATCH_SIZE}"),
    (["--n", "4"], "give --time-budget"),
    (["--time-budget", "1", "--batch-sizes", "2"], "does not combine with --batch-sizes"),
    (["--time-budget", "1", "--compare", "a", "b"], "does not combine with --compare"),
    (["--time-budget", "1", "--ratios", "a", "x/y"], "does not combine with --ratios"),
    (["--time-budget", "1", "--resume"], "does not combine with --resume"),
    (["--time-budget", "1", "--repeats", "2"], "drop --repeats"),
    (["--time-budget", "1", "--prompts", "sharegpt"], "needs --prompts humaneval, got 'sharegpt'"),
    (["--time-budget", "1", "--methods", "ar;hf"], "peers cannot run it"),
    (["--time-budget", "1", "--seed", str(2**64 - 1), "--n", "2"], "over 2**64 - 1"),
])
def test_bad_time_budget_arguments(bench, tmp_path, argv, message):
    prompts = [] if "--prompts" in argv else ["--prompts", "humaneval"]
    methods = [] if "--methods" in argv else ["--methods", "ar"]
    code, _, err = bench(*prompts, *methods, *argv, "--out", str(tmp_path / "o"))
    assert code == 2
    assert err.startswith("specstack: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "o").exists()
