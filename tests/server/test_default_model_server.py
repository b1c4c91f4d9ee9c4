"""The one server test on the embedded default model (SmolLM2-135M, int4, method auto, as a user starts it
with no flags but the port): a chat request through the openai client, streamed and whole, gives the text
`specstack generate --chat` prints for the same prompt, and drafts were verified on the way."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from conftest import start_server, stop_server

from specstack.cli import main

PROMPT = "Write a Python function that reverses a string."
TOKENS = 48


def test_default_model_chat_matches_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["generate", "--chat", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--jsonl"]) == 0
    expected = json.loads(out.getvalue())["text"]
    server = start_server("smollm2-135m", tmp_path, "--max-batch", "2", dtype=None)
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
        assert server.metrics()["specstack:spec_decode_num_draft_tokens_total{}"] > 0  # auto drafted
    finally:
        stop_server(server)
