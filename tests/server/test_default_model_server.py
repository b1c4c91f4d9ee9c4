"""The one server test on the embedded default model (SmolLM2-135M): a chat request through the openai
client, streamed and whole, gives the text plain decoding (`specstack generate --chat --method ar`) prints
for the same prompt, while the server speculates.

Both run in fp32, where greedy equality is exact. In int4 a verify forward of several tokens runs other
kernels than a one-token step, and `auto` sizes its drafts by measured timings: on an AMX Xeon it parts
from `ar` at token 29 of this prompt, a near-tie 0.125 below the top logit (bench-ties' tolerance 0.75).
The server drafts fixed n-gram chains (`ngram:depth=2`), not `auto`, so that drafts are verified on every
machine: `auto` drafts only where this machine's measured forward costs say a draft token pays, which a
test must not depend on."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from server.servers import start_server, stop_server

from specstack.cli.entry import main

PROMPT = "Write a Python function that reverses a string."
TOKENS = 48


def test_default_model_chat_matches_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["generate", "--chat", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--jsonl",
                     "--dtype", "fp32", "--method", "ar"]) == 0
    expected = json.loads(out.getvalue())["text"]
    server = start_server("smollm2-135m", tmp_path, "--max-batch", "2", "--method", "ngram:depth=2")
    try:
        client = server.client()
        args = {"model": "smollm2-135m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
                "temperature": 0}
        whole = client.chat.completions.create(**args)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                           if c.choices)
        assert whole.choices[0].message.content == expected
        assert streamed == expected
        assert whole.usage.completion_tokens == TOKENS
        m = server.metrics()
        drafted, accepted = (m[f"specstack:spec_decode_num_{k}_tokens_total{{}}"] for k in ("draft", "accepted"))
        assert 0 < accepted <= drafted  # drafts were verified, and some kept
        origins = sum(v for k, v in m.items() if k.startswith("specstack:generation_tokens_by_origin_total"))
        assert origins == m["specstack:generation_tokens_total{}"] == 2 * TOKENS
    finally:
        stop_server(server)
