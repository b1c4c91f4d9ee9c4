"""llama.cpp's own speculation as bench peers (bench/llama_server.py): a real llama-server process on
127.0.0.1, the embedded SmolLM2 GGUF drafting for itself. Its tokens per target forward and token origins
are counted as the engine counts its own (every forward yields one token of its own after the drafts it
accepted), so the τ column compares across peers. Needs the binary benchmarks/build_llama_cpp.sh builds:
skipped without it (CI does not build llama.cpp)."""
from __future__ import annotations

import json

import pytest

from specstack.bench.llama_server import server_binary

pytestmark = pytest.mark.skipif(server_binary(None)[0] is None, reason="llama-server not built "
                                "(benchmarks/build_llama_cpp.sh)")


def _run(bench, tmp_path, n: int, methods: str) -> tuple[dict, dict]:
    """One prompt, n tokens, SmolLM2 drafting for itself: the rows by method and summary.json."""
    out = tmp_path / "run"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"task_id": "fib", "prompt": "def fibonacci(n):"}) + "\n")
    code, _, err = bench("--model", "smollm2-135m", "--draft", "smollm2-135m", "--prompts", str(prompts),
                         "--max-new-tokens", str(n), "--threads", "2", "--out", str(out), "--methods", methods)
    assert code == 0, err
    rows = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    return rows, json.loads((out / "summary.json").read_text())


def test_llamacpp_spec_counts_forwards_and_origins(bench, tmp_path):
    rows, _ = _run(bench, tmp_path, 32, "ar;llamacpp-spec:max=4,pmin=50;llamacpp-ngram:n=3,max=4")
    spec = rows["llamacpp-spec:max=4,pmin=50"]
    accepted = spec["origins"]["draft"]
    assert 0 < accepted <= spec["drafted"]
    assert spec["target_forwards"] == spec["new_tokens"] - accepted == spec["origins"]["target"]
    assert spec["tau"] == pytest.approx(spec["new_tokens"] / spec["target_forwards"])
    assert spec["tau"] > 2  # the model drafting for itself: most drafts accepted, up to 4 a forward
    ngram = rows["llamacpp-ngram:n=3,max=4"]
    assert ngram["target_forwards"] == ngram["new_tokens"] - ngram["origins"]["draft"]


def test_llamacpp_server_decodes_plainly_and_says_its_build(bench, tmp_path):
    """`llamacpp-server` is llama-server without speculation (one target forward a token, nothing drafted),
    beside a speculating one in the same run; the report names its binary and build flags."""
    rows, summary = _run(bench, tmp_path, 24, "ar;llamacpp-server;llamacpp-spec:max=4,pmin=50")
    plain = rows["llamacpp-server"]
    assert plain["new_tokens"] == 24 and plain["target_forwards"] == 24 and plain["origins"] == {"draft": 0, "target": 24}
    assert "llama-server" in summary["peers"]["llamacpp-server"] and "GGML_AMX_INT8=OFF" in summary["peers"]["llamacpp-server"]
