"""llama.cpp as a peer of `specstack bench` through its own server: `llama-server` on the same GGUF,
plain (`llamacpp-server`: the binaries alone, no llama-cpp-python), with a draft model (`llamacpp-spec`:
`-md`, the same draft file specstack uses) or with its draft-free n-gram speculation (`llamacpp-ngram`:
`--spec-type ngram-simple`), one process per setting, started once on 127.0.0.1 and asked for each
prompt in turn.

A prompt goes as token ids (same GGUF, same vocabulary) to POST /completion with `n_predict` = n and
`ignore_eos` (exactly n tokens, as every method of the bench), `cache_prompt` false (every prompt pays
its prefill, as ours do), `return_tokens` (the ids, for identical_to_ar). The server's own counters
(`timings.draft_n`, `draft_n_accepted`) give its acceptance; the bench times the request, prefill
included, as it times ours. Its maintainers' advice for a draft model: draft max 16, p-min 0.75-0.9
(`max=`, `pmin=` in percent: `llamacpp-spec:max=16,pmin=80`).
"""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstack.bench import children
from specstack.bench.llama_batched import find_binary
from specstack.config import SamplingParams
from specstack.errors import SpecstackError

BINARY = "llama-server"
STARTUP_S = 180.0  # loading two GGUFs (mmap) and warming up
TIMEOUT_ENV = "SPECSTACK_PEER_TIMEOUT_S"
REQUEST_TIMEOUT_S = 900.0  # one generation: a peer that takes longer is taken for hung


def request_timeout() -> float:
    """Seconds a peer's generation may take (TIMEOUT_ENV overrides REQUEST_TIMEOUT_S)."""
    return float(os.environ.get(TIMEOUT_ENV) or REQUEST_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LlamaServer:
    """One llama-server process: `extra` its speculation flags."""

    binary: Path
    gguf: Path
    threads: int
    n_ctx: int
    extra: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    url: str = field(default="", init=False)
    drafted: int = field(default=0, init=False)
    accepted: int = field(default=0, init=False)

    def start(self) -> None:
        import httpx

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        argv = [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(self.n_ctx), "-np", "1", "--no-cache-prompt", "--host", "127.0.0.1", "--port", str(port),
                "--no-webui", *self.extra]
        with open(self.log, "wb") as f:  # its own process group, gone with the bench (bench/children.py)
            self.proc = children.start(argv, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpecstackError(f"llama-server {self._ended()} at start: {self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise SpecstackError(f"llama-server did not answer /health within {STARTUP_S:.0f} s: {self._tail()}")

    def _ended(self) -> str | None:
        return None if self.proc is None else children.ended(self.proc)

    def _tail(self) -> str:
        return children.log_tail(self.log)

    def generate(self, ids: Sequence[int], n: int, sampling: SamplingParams) -> list[int]:
        """Exactly n new token ids for the prompt ids (EOS ignored)."""
        import httpx

        body: dict[str, Any] = {"prompt": list(ids), "n_predict": n, "ignore_eos": True, "cache_prompt": False,
                                "return_tokens": True, "stream": False}
        if sampling.greedy:
            body |= {"temperature": 0.0, "top_k": 1}
        else:
            body |= {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        try:
            r = httpx.post(self.url + "/completion", json=body, timeout=request_timeout())
        except httpx.TimeoutException:
            raise SpecstackError(f"llama-server did not answer within {request_timeout():.0f} s "
                                 f"({TIMEOUT_ENV} sets the limit)") from None
        except httpx.HTTPError as e:
            ended = None if self.proc is None else children.ended_soon(self.proc)
            raise SpecstackError(f"llama-server {ended or 'dropped the request'} ({type(e).__name__}): "
                                 f"{self._tail()}") from None
        if r.status_code != 200:
            raise SpecstackError(f"llama-server answered {r.status_code}: {r.text[:200]}")
        doc = r.json()
        timings = doc.get("timings") or {}
        self.drafted += int(timings.get("draft_n") or 0)
        self.accepted += int(timings.get("draft_n_accepted") or 0)
        return [int(t) for t in doc.get("tokens") or []][:n]

    def close(self) -> None:
        if self.proc is not None:
            children.stop(self.proc)
        self.proc = None


def _draft_flags(params: dict[str, Any], draft_gguf: Path | None) -> list[str]:
    if draft_gguf is None:
        raise SpecstackError("llamacpp-spec needs a GGUF draft: pass --draft MODEL (a .gguf or a registered "
                             "model), the same draft the engine uses")
    return ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(params["max"]),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{params['pmin'] / 100:.2f}"]


def _ngram_flags(params: dict[str, Any], draft_gguf: Path | None) -> list[str]:
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(params["n"]),
            "--spec-ngram-simple-size-m", str(params["max"])]


# each llama-server peer of bench/peer_table.py -> its speculation flags (none: plain decoding)
SPEC_FLAGS: dict[str, Callable[[dict[str, Any], Path | None], list[str]]] = {
    "llamacpp-server": lambda params, draft_gguf: [], "llamacpp-spec": _draft_flags, "llamacpp-ngram": _ngram_flags}


def spec_flags(name: str, params: dict[str, Any], draft_gguf: Path | None) -> list[str]:
    """llama-server's speculation flags for a bench method (`llamacpp-server`, `llamacpp-spec`, `llamacpp-ngram`)."""
    return SPEC_FLAGS[name](params, draft_gguf)


def server_binary(bin_dir: Path | None) -> tuple[Path | None, str]:
    return find_binary(bin_dir, BINARY)
