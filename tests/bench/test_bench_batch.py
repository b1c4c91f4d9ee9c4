"""`specstack bench --batch-sizes` (batch mode) on a tiny random Llama with a JSONL prompt file: one
summary entry per method and batch size, batched rows identical to each prompt decoded alone (greedy
fp32), the batch figure, --resume; the pieces by hand (batches, the summary, llama-batched-bench's
output and command); bad arguments exit 2 before any model is loaded."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from bench.tiny_bench import save_tiny_bench_model

from specstack.bench import batch_report, llama_batched
from specstack.bench.batched import make_batches
from specstack.bench.datasets import EncodedPrompt

# four prompts of different lengths: ragged rows, and B = 2 divides the set (same rows at B = 1 and 2)
PROMPTS = [{"task_id": "add", "prompt": "def add(a, b):"}, {"task_id": "hi", "prompt": "hello there", "chat": True},
           {"task_id": "sky", "prompt": "The sky is"},
           {"task_id": "long", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""}]
FAST = ["--dtype", "fp32", "--draft-dtype", "fp32", "--max-new-tokens", "5", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of tests/bench/tiny_bench.py."""
    return save_tiny_bench_model(tmp_path_factory.mktemp("tiny-batch-llama") / "model", PROMPTS)


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# End to end on the tiny model
# ---------------------------------------------------------------------------------------------------
def test_batch_sizes_end_to_end(tiny, bench, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = bench(*tiny, "--methods", "ar;chain:k=2;hf;llamacpp-batched", "--batch-sizes", "1,2",
                              "--out", str(out), *FAST)
    assert code == 0, err
    assert (out / "batch_throughput.png").stat().st_size > 0
    assert not (out / "speedup_per_prompt.png").exists() and not (out / "origins.html").exists()
    doc = json.loads((out / "summary.json").read_text())
    methods = doc["methods"]
    keys = [f"{m}@b{b}" for m in ("ar", "chain:k=2", "hf") for b in (1, 2)]
    assert set(keys) <= set(methods) and "ar" in methods  # "ar": each prompt alone, the reference
    assert "not a GGUF" in doc["skipped"]["llamacpp-batched"]

    rows = rows_of(out)
    batch = [r for r in rows if "batch_size" in r]
    single = {r["task_id"]: r for r in rows if "batch_size" not in r}
    assert set(single) == {p["task_id"] for p in PROMPTS} and all(r["method"] == "ar" for r in single.values())
    for key in keys:
        mine = [r for r in batch if r["method"] == key]
        b = int(key.rpartition("@b")[2])
        assert len(mine) == len(PROMPTS)  # the same rows at every B: every prompt once
        assert sorted(r["task_id"] for r in mine) == sorted(single)
        assert all(r["new_tokens"] == 5 == len(r["tokens"]) and r["batch_size"] == b for r in mine)
        # a batch is B consecutive prompts of the set
        for bi in range(len(PROMPTS) // b):
            in_batch = sorted((r["slot"], r["task_id"]) for r in mine if r["batch"] == bi)
            assert [t for _, t in in_batch] == [p["task_id"] for p in PROMPTS[bi * b:(bi + 1) * b]]
            assert len({r["seconds"] for r in mine if r["batch"] == bi}) == 1  # the batch's wall time
        s = methods[key]
        assert s["rows"] == len(PROMPTS) and s["batch_size"] == b and s["batches"] == len(PROMPTS) // b
        walls = {(r["batch"], r["repeat"]): r["seconds"] for r in mine}
        assert s["tokens_per_s"] == pytest.approx(5 * len(PROMPTS) / sum(walls.values()))
        assert s["ms_per_token"] == pytest.approx(sum(1e3 * r["seconds"] / 5 for r in mine) / len(mine))
    for key in ("ar@b1", "ar@b2", "chain:k=2@b1", "chain:k=2@b2"):  # greedy fp32: each row as if alone
        assert methods[key]["identical_rate"] == 1.0, key
        assert set(methods[key]["phases"]) == {"draft", "target", "verify", "overhead"}
        assert methods[key]["steps"] >= methods[key]["batches"]
    assert methods["ar@b2"]["tau"] == pytest.approx(1.0) and methods["chain:k=2@b2"]["tau"] >= 1.0
    assert methods["hf@b2"]["phases"] is None and isinstance(methods["hf@b2"]["identical_rate"], float)
    # the draft's forwards a step: none for ar, a chain group's k for all its rows (and a read-ahead), none counted for hf
    assert methods["ar@b2"]["draft_forwards_per_step"] == 0 and methods["hf@b2"]["draft_forwards_per_step"] is None
    assert 0 < methods["chain:k=2@b2"]["draft_forwards_per_step"] <= 3
    assert methods["ar@b2"]["speedup_vs_single_ar"] == pytest.approx(
        methods["ar@b2"]["tokens_per_s"] / methods["ar"]["tokens_per_s"])
    # interleaved: the method order turns by one from batch to batch
    first = [next(r["method"] for r in batch if r["batch_size"] == 1 and r["batch"] == bi) for bi in range(3)]
    assert first == ["ar@b1", "chain:k=2@b1", "hf@b1"]

    md = (out / "summary.md").read_text()
    assert md in stdout and "## Batches (B = 1, 2)" in md and "| ar@b2 | 2 | fp32 |" in md
    assert "wrapping around" in md and "llamacpp-batched: skipped" in md

    # --resume: every batch is there, nothing runs again; the report is rebuilt
    code, _, err = bench(*tiny, "--methods", "ar;chain:k=2;hf;llamacpp-batched", "--batch-sizes", "1,2",
                         "--out", str(out), "--resume", *FAST)
    assert code == 0, err
    assert rows_of(out) == rows
    code, _, err = bench(*tiny, "--methods", "ar", "--batch-sizes", "1,4", "--out", str(out), "--resume", *FAST)
    assert code == 2 and "--batch-sizes was [1, 2]" in err


def test_batch_layouts_and_sampling(tiny, bench, tmp_path):
    out = tmp_path / "run"
    code, _, err = bench(*tiny, "--limit", "3", "--methods", "ar:layout=pad;ar:layout=split", "--batch-sizes", "2",
                         "--temperature", "0.8", "--seed", "1", "--out", str(out), *FAST)
    assert code == 0, err
    methods = json.loads((out / "summary.json").read_text())["methods"]
    pad, split = methods["ar:layout=pad@b2"], methods["ar:layout=split@b2"]
    assert set(pad["layouts"]) == {"pad"} and set(split["layouts"]) == {"split"}
    assert pad["identical_rate"] is None and split["identical_rate"] is None  # sampling: no reference
    assert pad["rows"] == 4 and pad["prompts"] == 3  # 3 prompts at B = 2: the last batch wraps to the first
    rows = [r for r in rows_of(out) if r["method"] == "ar:layout=pad@b2"]
    assert [(r["batch"], r["task_id"]) for r in rows] == [(0, "add"), (0, "hi"), (1, "sky"), (1, "add")]


# ---------------------------------------------------------------------------------------------------
# Pieces by hand
# ---------------------------------------------------------------------------------------------------
def test_make_batches_wraps_around():
    ps = [EncodedPrompt(t, t, False, [1]) for t in "abcde"]
    assert [[p.task_id for p in b] for b in make_batches(ps, 2)] == [["a", "b"], ["c", "d"], ["e", "a"]]
    assert [[p.task_id for p in b] for b in make_batches(ps, 8)] == [["a", "b", "c", "d", "e", "a", "b", "c"]]
    assert len(make_batches(ps, 1)) == 5 and len(make_batches(ps, 5)) == 1


def _brow(method: str, b: int, batch: int, seconds: float, n: int = 10, **kw) -> dict:
    return {"task_id": f"t{batch}", "method": f"{method}@b{b}", "base_method": method, "batch_size": b,
            "batch": batch, "repeat": 0, "new_tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
            "dtype": "int4", **kw}


def test_summarize_batches_by_hand(tmp_path):
    rows = [_brow("ar", 2, 0, 2.0, tau=1.0, identical_to_ar=True,
                  batch_phases={"draft": 0.0, "target": 1.5, "verify": 0.1, "overhead": 0.4}, batch_steps=10),
            _brow("ar", 2, 0, 2.0, tau=1.0, identical_to_ar=False,
                  batch_phases={"draft": 0.0, "target": 1.5, "verify": 0.1, "overhead": 0.4}, batch_steps=10),
            _brow("ar", 2, 1, 3.0, tau=1.0, identical_to_ar=True,
                  batch_phases={"draft": 0.0, "target": 2.5, "verify": 0.1, "overhead": 0.4}, batch_steps=10),
            _brow("ar", 2, 1, 3.0, tau=1.0, identical_to_ar=True,
                  batch_phases={"draft": 0.0, "target": 2.5, "verify": 0.1, "overhead": 0.4}, batch_steps=10),
            # llama-batched-bench: one row for a whole batch of 4 rows x 8 tokens
            _brow("llamacpp-batched", 4, 0, 0.5, n=32, aggregate=True, seconds_with_prefill=1.0)]
    s = batch_report.summarize_batches(rows, ["llamacpp-batched@b4", "ar@b2"], single_ar=2.0)
    assert list(s) == ["llamacpp-batched@b4", "ar@b2"]
    ar = s["ar@b2"]
    assert ar["tokens_per_s"] == pytest.approx(40 / 5.0)  # each batch's wall time once
    assert ar["speedup_vs_single_ar"] == pytest.approx(4.0)
    assert ar["ms_per_token"] == pytest.approx((200 + 200 + 300 + 300) / 4)
    assert ar["identical_rate"] == 0.75 and ar["tau"] == 1.0 and ar["steps"] == 20 and ar["batches"] == 2
    assert ar["phases"] == pytest.approx({"draft": 0.0, "target": 4.0, "verify": 0.2, "overhead": 0.8})
    llama = s["llamacpp-batched@b4"]
    assert llama["tokens_per_s"] == pytest.approx(64.0) and llama["tokens_per_s_with_prefill"] == pytest.approx(32.0)
    assert llama["ms_per_token"] == pytest.approx(1e3 * 0.5 / 8) and llama["prompts"] == 0
    assert llama["tau"] is None and llama["identical_rate"] is None and llama["phases"] is None
    table = batch_report.batch_table(s, "ar")
    assert "| ar@b2 | 2 | int4 | 2 | 4 | 8.0 | 8.0 | 4.00 | 250.0 | 1.00 | 75 % | target 80 %" in table
    batch_report.plot_batch_throughput(s, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0


LLAMA_OUT = """build: 1 (abc) with cc
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, \
"n_threads": 2, "n_threads_batch": 2, "pp": 100, "tg": 8, "pl": 1, "n_kv": 108, "t_pp": 0.5, "speed_pp": 200.0, \
"t_tg": 0.1, "speed_tg": 80.0, "t": 0.6, "speed": 180.0}
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, \
"n_threads": 2, "n_threads_batch": 2, "pp": 100, "tg": 8, "pl": 4, "n_kv": 432, "t_pp": 1.5, "speed_pp": 266.7, \
"t_tg": 0.2, "speed_tg": 160.0, "t": 1.7, "speed": 254.1}
llama_perf_context_print: load time = 1 ms
"""


def test_llama_batched_bench_records_and_command(tmp_path, monkeypatch):
    rows = llama_batched.record_rows(llama_batched.parse_records(LLAMA_OUT), "llamacpp-batched")
    assert [(r["method"], r["new_tokens"], r["tokens_per_s"]) for r in rows] == [
        ("llamacpp-batched@b1", 8, 80.0), ("llamacpp-batched@b4", 32, 160.0)]
    s = batch_report.summarize_batches(rows, [], None)
    assert s["llamacpp-batched@b4"]["tokens_per_s"] == pytest.approx(160.0)  # its speed_tg

    run = llama_batched.LlamaBatched(Path("/bin/llama-batched-bench"), Path("m.gguf"), 300, 128, (1, 4, 32), 2)
    cmd = run.command()
    assert run.context >= 32 * (300 + 128)
    assert cmd[cmd.index("-npl") + 1] == "1,4,32" and cmd[cmd.index("-npp") + 1] == "300"
    assert cmd[cmd.index("-ntg") + 1] == "128" and cmd[cmd.index("-t") + 1] == "2" and cmd[-1] == "jsonl"

    # found through $SPECSTACK_LLAMA_BIN_DIR, or a reason naming where it looked
    monkeypatch.setenv(llama_batched.ENV_BIN_DIR, str(tmp_path))
    found, why = llama_batched.find_binary(None)
    assert found is None and str(tmp_path) in why
    fake = tmp_path / llama_batched.BINARY
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert llama_batched.find_binary(None) == (fake, "") and os.access(fake, os.X_OK)


# ---------------------------------------------------------------------------------------------------
# Bad arguments: one line, exit 2, before any model is loaded
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes must be >= 1, got 0"),
    (["--batch-sizes", "-1"], "--batch-sizes must be >= 1"),
    (["--batch-sizes", "1.5"], "--batch-sizes must be an integer"),
    (["--batch-sizes", "2,x"], "--batch-sizes must be an integer"),
    (["--batch-sizes", ""], "--batch-sizes needs at least one value"),
    (["--batch-sizes", "1,,2"], "--batch-sizes must be comma-separated integers"),
    (["--batch-sizes", "1", "--methods", "hf-pld"], "not a batched method"),
    (["--methods", "llamacpp-batched"], "runs batches only; give --batch-sizes"),
    (["--methods", "ar:layout=pad"], "layout= lays out the rows of a batch"),
    (["--batch-sizes", "2", "--methods", "ar:layout=diagonal"], "layout must be one of auto, pad, split"),
    (["--batch-sizes", "2", "--methods", "ar;ar:layout=auto"], "listed twice"),
    (["--batch-sizes", "2", "--llama-bin-dir", "/nonexistent/bin"], "--llama-bin-dir /nonexistent/bin: not a folder"),
])
def test_bad_batch_arguments(bench, tmp_path, argv, message):
    methods = [] if "--methods" in argv else ["--methods", "ar"]
    code, _, err = bench("--prompts", "humaneval", *methods, *argv, "--out", str(tmp_path / "o"))
    assert code == 2
    assert err.startswith("specstack: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "o").exists()
