"""Servers for the server tests: `specstack serve` started as a real process on 127.0.0.1
(conftest.py's fixtures use these; a test imports them as `server.servers`).

Each server runs a tiny random Llama checkpoint (the default model's tokenizer and chat template, a
256-token context) in fp32, so greedy outputs are exact and a whole request takes milliseconds. The
process picks a free port (`--port 0`) and prints its URL on stderr, which goes to a file (a pipe
nobody drains would block it); the fixture waits for `/health` 200. On teardown the server is stopped
with SIGTERM and must exit cleanly.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SERVER_CONTEXT = 256
URL_LINE = re.compile(r"listening on (http://\S+)")
TOKENS = 24  # max_tokens of the requests the tests compare


@dataclass
class Server:
    """A running `specstack serve`: `.url` ends in /v1 (the OpenAI client's base_url)."""

    process: subprocess.Popen[bytes]
    root: str  # http://127.0.0.1:PORT
    model: str  # the id it serves
    log: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.root + "/v1"

    def client(self, **kwargs: object):
        from openai import OpenAI

        return OpenAI(**{"base_url": self.url, "api_key": self.api_key or "none", "max_retries": 0, "timeout": 60,
                         **kwargs})

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels: `name{k="v",...}` -> value (parsed by prometheus_client)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.root + "/metrics").text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(model: Path | str, tmp: Path, *flags: str, wait: bool = True, api_key: str | None = None,
                 dtype: str | None = "fp32") -> Server:
    """`specstack serve --model MODEL` on a free port of 127.0.0.1 (fp32 unless dtype says otherwise: None is
    the server's default), converted weights cached in tmp."""
    log = tmp / f"serve-{time.monotonic_ns()}.log"
    env = {**os.environ, "SPECSTACK_CACHE": str(tmp / "cache")}
    argv = [sys.executable, "-m", "specstack.cli", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
            "--threads", "1", *(["--dtype", dtype] if dtype else []), *flags]
    if api_key is not None:
        argv += ["--api-key", api_key]
    with log.open("wb") as f:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f, env=env)
    deadline = time.monotonic() + 60
    root = None
    while root is None:
        match = URL_LINE.search(log.read_text(errors="replace"))
        if match:
            root = match.group(1)
        elif process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the server did not start:\n{log.read_text(errors='replace')}")
        else:
            time.sleep(0.05)
    server = Server(process, root, str(model), log, api_key)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.root + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.process.poll() is not None:
            break
        time.sleep(0.05)
    server.process.kill()  # the fixture that started it fails here, before its stop_server: none is left behind
    server.process.wait()
    raise AssertionError(f"the server never became ready:\n{server.stderr()}")


def stop_server(server: Server) -> None:
    """SIGTERM, as a service manager stops it: it must exit by itself, without a traceback."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
            raise AssertionError(f"the server did not stop on SIGTERM:\n{server.stderr()}") from None
    assert "Traceback" not in server.stderr(), server.stderr()


def complete(server: Server, prompt: str, stream: bool, **kw: object) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of one greedy /v1/completions request."""
    client = server.client()
    args = {"model": server.model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, **kw}
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, reason, usage = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.text)
            reason = c.finish_reason or reason
    return "".join(text), reason, usage


def chat(server: Server, prompt: str, stream: bool) -> str:
    client = server.client()
    args = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
            "temperature": 0}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                   if c.choices)
