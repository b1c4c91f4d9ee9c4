"""`specstack bench-serve` end to end against our own server (tests/server/conftest.py's `tiny_server`: a
real `specstack serve` process on a tiny fp32 model): every request that was not cancelled on purpose
ends ok with exactly its max_tokens, greedy texts agree per prompt across levels, and the report is
written."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from specstack.cli.entry import main

MAX_TOKENS = 16


@pytest.fixture
def short_prompts(tmp_path: Path) -> Path:
    """Four short prompts: the tiny server's context is 256 tokens, too few for HumanEval's."""
    path = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b):", "The capital of France is", "for i in range(", "Once upon a time"]
    path.write_text("".join(json.dumps({"task_id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


def bench_serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench-serve", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_serve_against_our_server(capsys, tiny_server, short_prompts, tmp_path):
    out = tmp_path / "bench"
    code, stdout, err = bench_serve(capsys, "--url", tiny_server.url, "--prompts", str(short_prompts),
                                    "--concurrency", "1,4", "--requests", "8", "--max-tokens", str(MAX_TOKENS),
                                    "--ignore-eos", "--disconnect", "0.125", "--timeout", "120", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "serve.json").read_text())
    assert doc["settings"]["model"] == tiny_server.model  # the first id of GET /v1/models
    assert [lv["level"] for lv in doc["levels"]] == ["c1", "c4"]
    for lv in doc["levels"]:
        assert (lv["requests"], lv["ok"], lv["errors"], lv["cancelled"]) == (8, 7, 0, 1), lv
        assert lv["output_tokens"] == 7 * MAX_TOKENS and lv["tokens_per_s"] > 0
        assert lv["ttft_ms_p50"] > 0 and lv["itl_ms_p50"] > 0 and lv["tokens_per_chunk"] >= 1
        assert lv["consistency"] == {"prompts_checked": 4, "mismatched": 0, "mismatched_prompts": []}
    assert doc["consistency"]["mismatched"] == 0, doc["consistency"]  # batch of 1 and of 4: the same texts
    for r in doc["rows"]:
        if r["status"] == "ok":
            assert r["usage_tokens"] == MAX_TOKENS and r["output_tokens"] == MAX_TOKENS and r["text"]
        else:
            assert r["status"] == "cancelled" and r["chunks"] == 2, r
    rss = doc["server_rss_bytes"]
    assert rss["before"] > 0 and rss["after"] > 0  # prometheus_client's process collector
    assert {p.name for p in out.iterdir()} == {"serve.json", "serve.md", "serve.png"}
    assert stdout.startswith("| level |") and stdout.count("\n") == 4
    assert "concurrency 4: 7 ok, 0 errors, 1 cancelled" in err


def test_bench_serve_chat_at_a_rate(capsys, tiny_server, short_prompts, tmp_path):
    out = tmp_path / "chat"
    code, _, err = bench_serve(capsys, "--url", tiny_server.url, "--model", tiny_server.model, "--prompts",
                               str(short_prompts), "--endpoint", "chat", "--rate", "20", "--requests", "4",
                               "--max-tokens", "8", "--ignore-eos", "--timeout", "120", "--out", str(out))
    assert code == 0, err
    (lv,) = json.loads((out / "serve.json").read_text())["levels"]
    assert (lv["level"], lv["ok"], lv["output_tokens"]) == ("r20", 4, 32)


def test_smoke_load_with_disconnects(capsys, tiny_server, short_prompts, tmp_path):
    """The load goal's bounded version: 40 streamed requests at concurrency 8, two clients leaving
    mid-stream; none lost or corrupted, and every row freed."""
    out = tmp_path / "load"
    code, _, err = bench_serve(capsys, "--url", tiny_server.url, "--prompts", str(short_prompts), "--concurrency", "8",
                               "--requests", "40", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                               "--disconnect", "0.05", "--timeout", "120", "--out", str(out))
    assert code == 0, err
    (lv,) = json.loads((out / "serve.json").read_text())["levels"]
    assert (lv["ok"], lv["errors"], lv["cancelled"]) == (38, 0, 2), lv
    assert lv["output_tokens"] == 38 * MAX_TOKENS
    assert lv["consistency"]["mismatched"] == 0
    deadline = time.monotonic() + 10  # the last cancellations reach the engine at its next step
    while tiny_server.metrics()["specstack:num_requests_running{}"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_server.metrics()["specstack:num_requests_running{}"] == 0
