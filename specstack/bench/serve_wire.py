"""The OpenAI streaming API as the load generator speaks it, pure functions only: the body of a
streamed request for either endpoint, the payload of an SSE line, the output text of a streamed event,
a server's error in one short line, and the server's resident memory read from its Prometheus text.

A *content chunk* is a streamed event that carries output text (a chat stream's role-only first delta,
the usage chunk and empty texts are not content). A speculative server may put several tokens in one
chunk, so serve_stats.py measures the inter-token latency per chunk.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from specstack.bench.datasets import Prompt
from specstack.bench.serve_settings import LoadSettings

ENDPOINTS = ("completions", "chat")
ERROR_CHARS = 200  # of a server's error message kept in a row


def endpoint_of(prompt: Prompt, endpoint: str | None) -> str:
    return endpoint or ("chat" if prompt.chat else "completions")


def request_body(prompt: Prompt, endpoint: str, model: str, s: LoadSettings, max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request for `prompt` (a chat request holds it as one user message)."""
    if endpoint == "chat":
        return streamed_body({"messages": [{"role": "user", "content": prompt.text}]}, model, s, max_tokens)
    return streamed_body({"prompt": prompt.text}, model, s, max_tokens)


def streamed_body(payload: Mapping[str, Any], model: str, s: LoadSettings, max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request: `payload` (`prompt` or `messages`, and e.g. `n`) with the
    settings every request of a run shares."""
    body: dict[str, Any] = {"model": model, **payload}
    body.update(max_tokens=max_tokens or s.max_tokens, temperature=s.temperature, stream=True,
                stream_options={"include_usage": True})
    if s.ignore_eos:
        body["ignore_eos"] = True  # read by vLLM and llama-server (and ours): exactly max_tokens, equal work
    body.update(s.extra_body)
    return body


def path_of(endpoint: str) -> str:
    return "/chat/completions" if endpoint == "chat" else "/completions"


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for anything else (comments, event names, blank lines)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def chunk_text(event: Mapping[str, Any]) -> str:
    """The output text of one streamed event of either endpoint (choice 0: one completion per request)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def chunk_choice(event: Mapping[str, Any]) -> int:
    """The index of the choice a streamed event carries (0 when the server leaves it out)."""
    choices = event.get("choices") or []
    index = choices[0].get("index", 0) if choices and isinstance(choices[0], dict) else 0
    return index if isinstance(index, int) else 0


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_counts(event: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached prompt tokens) of an event that carries them, else None for each.

    Cached tokens are OpenAI's `usage.prompt_tokens_details.cached_tokens` (ours, vLLM); a server
    that leaves it out but sends llama.cpp's `timings.cache_n` (llama-server's prompt cache) is read
    from that, so the three servers of benchmarks/prefix_cache compare on one column."""
    usage = event.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    timings = event.get("timings")
    if cached is None and isinstance(timings, dict):
        cached = _count(timings.get("cache_n"))
    return _count(usage.get("prompt_tokens")), cached


def error_message(body: bytes | str) -> str:
    """A server's error in one short line: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    text = " ".join(text.split())
    return text[:ERROR_CHARS] + ("..." if len(text) > ERROR_CHARS else "")


def parse_rss(metrics: str) -> int | None:
    """process_resident_memory_bytes from Prometheus text (prometheus_client's process collector)."""
    return gauge(metrics, "process_resident_memory_bytes")


def gauge(metrics: str, name: str) -> int | None:
    """The first sample of metric `name` (any labels) in Prometheus text, as an int, or None."""
    m = re.search(r"^" + re.escape(name) + r"(?:\{[^}]*\})?\s+(\S+)", metrics, re.MULTILINE)
    if not m:
        return None
    try:
        return int(float(m.group(1)))
    except ValueError:
        return None
