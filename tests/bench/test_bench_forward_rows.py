"""`specstack bench-forward --rows ... [--ragged]` (issue 19): the batched curve (B rows x T tokens per
format) and the PAD/SPLIT crossover (one row's prompt chunk beside decoding rows) on a tiny random
Llama: one JSON row per (format, rows, T), both layouts per (rows, chunk), the markdown report and the
figure beside the JSON (one-row runs write the JSON alone, as before); the timed ragged forward computes what the engine's does (the same last-token
logits in both layouts as each row alone); bad --rows/--chunk values exit 2 before any model loads."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

import specstack.bench.forward
from specstack.attention import build_batch
from specstack.engine.timing import RowForwards
from specstack.models.loading import load_model

FAST = ["--formats", "fp32", "--context", "8", "--repeats", "1", "--warmup", "0", "--prompts", "0", "--skip-hf",
        "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-forward-llama"))


@pytest.fixture
def tiny(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("SPECSTACK_CACHE", str(tiny_dir.parent / "specstack-cache"))
    return ["--model", str(tiny_dir)]


# ---------------------------------------------------------------------------------------------------
# End to end on the tiny model
# ---------------------------------------------------------------------------------------------------
def test_rows_curve_end_to_end(tiny, bench_forward, tmp_path):
    out = tmp_path / "run" / "forward.json"
    code, stdout, err = bench_forward(*tiny, *FAST, "--rows", "1,2", "--tokens", "1,2", "--out", str(out))
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["settings"]["rows"] == [1, 2] and doc["settings"]["ragged"] is False and doc["ragged"] is None
    chain = {(r["rows"], r["tokens"]) for r in doc["forward"] if r["method"] == "specstack fp32 chain"}
    assert chain == {(1, 1), (1, 2), (2, 1), (2, 2)}
    tree = {(r["rows"], r["tokens"]) for r in doc["forward"] if r["method"] == "specstack fp32 tree"}
    assert tree == {(1, 1), (1, 2)}  # trees at one row only
    assert all(r["median_ms"] > 0 and len(r["times_ms"]) == 1 for r in doc["forward"])
    (limit,) = doc["limits"]  # the step's floor: its bytes at the measured bandwidth
    assert limit["fmt"] == "fp32" and limit["limit_ms"] == pytest.approx(limit["bytes"] / doc["machine"]["bandwidth_gbs"] / 1e6)
    assert limit["read_limit_ms"] == pytest.approx(limit["bytes"] / doc["machine"]["read_bandwidth_gbs"] / 1e6)
    md = (out.parent / "forward.md").read_text()
    assert "## The physical limit of a one-token step" in md and "| fp32 | " in md and "GB/s read (ms)" in md
    assert "llama-bench: not run (" in md and "is not a GGUF file" in md  # a checkpoint folder: no peer
    assert md.strip() in stdout  # the printed report is the file
    assert "## Batched forward" in md and "| rows B | T = 1 | T = 2 |" in md
    # B x T in ms, each against one row of one token (itself 1.00x)
    assert re.search(r"^\| 1 \| \d+\.\d \(1\.00x\) \| \d+\.\d \(\d+\.\d\dx\) \|$", md, re.M), md
    assert re.search(r"^\| 2 \| \d+\.\d \(\d+\.\d\dx\) \| \d+\.\d \(\d+\.\d\dx\) \|$", md, re.M), md
    png = out.parent / "forward_rows.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ragged_crossover_end_to_end(tiny, bench_forward, tmp_path):
    out = tmp_path / "forward.json"
    (tmp_path / "forward_rows.png").write_bytes(b"an earlier run's figure")
    code, stdout, err = bench_forward(*tiny, *FAST, "--rows", "3", "--tokens", "1", "--ragged", "--chunk", "3",
                                      "--out", str(out))
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert [(r["method"], r["rows"], r["tokens"]) for r in doc["forward"]] == [("specstack fp32 chain", 3, 1)]
    ragged = {(r["rows"], r["chunk"], r["layout"]) for r in doc["ragged"]}
    assert ragged == {(3, c, layout) for c in (1, 3) for layout in ("pad", "split")}  # 1: the uniform step
    assert all(r["method"] == "specstack fp32" and r["median_ms"] > 0 for r in doc["ragged"])
    md = (tmp_path / "forward.md").read_text()
    assert "| method | rows B | chunk C | pad ms | split ms | faster |" in md
    assert "| specstack fp32 | 3 | 1 (uniform) |" in md and "| specstack fp32 | 3 | 3 |" in md
    assert "- specstack fp32, B = 3: " in md
    assert "## Forward of T query tokens" not in md  # no one-row part without rows 1
    assert not (tmp_path / "forward_rows.png").exists()  # one row count: no curve, and no stale figure


def test_default_rows_keep_the_one_row_benchmark(tiny, bench_forward, tmp_path):
    """Without --rows the run is today's: one row, chains and trees, the JSON file alone."""
    out = tmp_path / "forward.json"
    code, stdout, err = bench_forward(*tiny, *FAST, "--tokens", "2", "--out", str(out))
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert [(r["method"], r["rows"]) for r in doc["forward"]] == [("specstack fp32 chain", 1), ("specstack fp32 tree", 1)]
    assert "## Forward of T query tokens" in stdout and "## Batched forward" not in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forward.json"]


def test_a_llama_bin_dir_is_written_into_the_report_as_a_string(tiny, bench_forward, tmp_path):
    """--llama-bin-dir (a path) goes into forward.json's settings like --out: the run's JSON is written."""
    out = tmp_path / "forward.json"
    code, _, err = bench_forward(*tiny, *FAST, "--tokens", "2", "--out", str(out), "--llama-bin-dir", str(tmp_path))
    assert code == 0, err
    assert json.loads(out.read_text())["settings"]["llama_bin_dir"] == str(tmp_path)


# ---------------------------------------------------------------------------------------------------
# The timed forwards compute the engine's step
# ---------------------------------------------------------------------------------------------------
def test_ragged_forwards_give_each_rows_own_logits_in_both_layouts(tiny_dir, monkeypatch):
    """Three rows at the same context: two decoding rows of one token and a chunk of three. PAD and
    SPLIT return the same last-token logits, equal to each row's block run alone, and neither moves
    the committed cache (the next forward runs at the same context)."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tiny_dir.parent / "specstack-cache"))
    lm = load_model(str(tiny_dir), dtype="fp32")
    ctx = list(range(5, 15))
    fwd = RowForwards(lm, ctx, max_rows=4, scratch=3)
    fwd.keep(3)
    blocks = [[101], [202], [7, 8, 9]]
    pad = torch.tensor([b + [0] * (3 - len(b)) for b in blocks])
    split = torch.tensor([[x for b in blocks for x in b]])
    got_pad = fwd.ragged([1, 1, 3], "pad")(pad)
    got_split = fwd.ragged([1, 1, 3], "split")(split)
    assert got_pad.shape == got_split.shape == (3, lm.config.vocab_size)
    torch.testing.assert_close(got_pad, got_split, rtol=1e-4, atol=1e-4)
    alone = lm.model.new_cache(1, len(ctx) + 3)
    lm.model.extend(torch.tensor([ctx]), alone)
    for row, block in enumerate(blocks):
        want = lm.model.forward(torch.tensor([block]), build_batch(alone, len(block)), alone)
        torch.testing.assert_close(got_split[row], want.logits[0, -1], rtol=1e-4, atol=1e-4)
    assert fwd.cache.lengths == [len(ctx)] * 3
    fwd.chain(torch.tensor([[1, 2]] * 3))  # a uniform step after the ragged ones: same context
    assert fwd.cache.lengths == [len(ctx)] * 3
    with pytest.raises(ValueError, match="rows are only dropped"):
        fwd.keep(4)


# ---------------------------------------------------------------------------------------------------
# Bad arguments: exit 2, one error line, nothing loaded or written
# ---------------------------------------------------------------------------------------------------
def fail(*_a, **_k):
    raise AssertionError("the bench ran although the arguments are invalid")


@pytest.mark.parametrize("argv, phrase", [
    (("--rows", "0"), "--rows must be >= 1, got 0"),
    (("--rows", "-1"), "--rows must be >= 1, got -1"),
    (("--rows", "1.5"), "--rows must be an integer, got '1.5'"),
    (("--rows", "1,x"), "--rows must be an integer, got 'x'"),
    (("--rows", "1,,2"), "--rows must be comma-separated integers"),
    (("--rows", ","), "--rows needs at least one value"),
    (("--rows", "100000"), "--rows must be <= 1024, got 100000"),
    (("--rows", "2", "--ragged", "--chunk", "0"), "--chunk must be >= 1, got 0"),
    (("--rows", "2", "--ragged", "--chunk", "-3"), "--chunk must be >= 1, got -3"),
    (("--rows", "2", "--ragged", "--chunk", "16,2.5"), "--chunk must be an integer, got '2.5'"),
    (("--ragged",), "--ragged times a prompt chunk beside decoding rows: --rows needs a value of at least 2, got 1"),
    (("--rows", "1", "--ragged"), "--rows needs a value of at least 2, got 1"),
], ids=["rows 0", "rows negative", "rows float", "rows text", "rows empty item", "rows empty", "rows huge",
        "chunk 0", "chunk negative", "chunk float", "ragged default rows", "ragged one row"])
def test_bad_rows_and_chunks_exit_2_before_loading(bench_forward, monkeypatch, tmp_path, argv, phrase):
    monkeypatch.setattr(specstack.bench.forward, "run_forward_bench", fail)
    out = tmp_path / "forward.json"
    code, stdout, err = bench_forward(*argv, "--out", str(out))
    assert code == 2 and stdout == "", err
    (line,) = err.splitlines()
    assert line.startswith("specstack: error: ") and phrase in line, line
    assert not out.exists()


def test_chunk_without_ragged_warns(bench_forward, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(specstack.bench.forward, "run_forward_bench", lambda s, _c: ran.append(s))
    code, _, err = bench_forward("--chunk", "8", "--rows", "1,2", "--out", str(tmp_path / "f.json"))
    assert code == 0 and err.splitlines() == ["specstack: warning: --chunk does nothing without --ragged"]
    assert ran[0].rows == [1, 2] and ran[0].ragged is False


def test_an_unwritable_report_beside_out_fails_before_the_bench(bench_forward, monkeypatch, tmp_path):
    monkeypatch.setattr(specstack.bench.forward, "run_forward_bench", fail)
    (tmp_path / "forward.md").mkdir()
    code, _, err = bench_forward("--rows", "1,4", "--out", str(tmp_path / "forward.json"))
    assert code == 2 and err.startswith("specstack: error: beside --out, ") and "forward.md is a folder" in err, err
    assert not (tmp_path / "forward.json").exists()
