"""llama-cpp-python in a process of its own (the `llamacpp` and `llamacpp-pld` peers of `specstack bench`):
a native build that crashes (a segfault in decode, as AMX builds do on some Xeons) or hangs takes only
this process down, and the bench reports the peer as failed and goes on (bench/run.py).

The parent (`LlamaCppChild`) starts `python -m specstack.bench.llama_cpp_child` through bench/children.py
(its own process group, gone with the bench) and talks to it in JSON lines over its stdin/stdout: one
`load` (the GGUF, context, threads, prompt-lookup tokens), then `generate` requests (token ids, n, the
sampling settings), each answered with the tokens or an error. The bench times the request round trip,
a pipe's microseconds beside a generation's seconds. The child's stderr goes to a log whose last lines
a failure quotes.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench import children
from specstack.bench.llama_server import request_timeout
from specstack.config import SamplingParams
from specstack.errors import SpecstackError

LOAD_TIMEOUT_S = 300.0
# a native build that crashes: most often one that turned AMX on (llama.cpp's AMX code segfaults on some
# of our Xeons) or an instruction set the CPU lacks
REBUILD_HINT = ("; rebuild llama-cpp-python for this CPU with AMX off: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON "
                "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install "
                "--force-reinstall --no-cache-dir llama-cpp-python (docs/benchmarks.md, 'Peers', has the flags)")


class LlamaCppChild:
    """One llama-cpp-python model in a child process."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, prompt_lookup: int = 0) -> None:
        self.log = Path(tempfile.mkstemp(prefix="llama-cpp-python-", suffix=".log")[1])
        with open(self.log, "wb") as err:
            self.proc = children.start([sys.executable, "-m", "specstack.bench.llama_cpp_child"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self._ask({"load": str(gguf), "threads": threads, "n_ctx": n_ctx, "prompt_lookup": prompt_lookup},
                  LOAD_TIMEOUT_S)

    def generate(self, ids: list[int], n: int, sampling: SamplingParams) -> list[int]:
        """Exactly n new token ids for the prompt ids (EOS ignored), from the child."""
        reply = self._ask({"ids": list(ids), "n": n, "sampling": asdict(sampling)}, request_timeout())
        return [int(t) for t in reply["tokens"]]

    def close(self) -> None:
        children.stop(self.proc)

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("did not take the request") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise SpecstackError(f"llama-cpp-python did not answer within {timeout:.0f} s (SPECSTACK_PEER_TIMEOUT_S "
                                 "sets the limit)")
        line = self.proc.stdout.readline()
        if not line:
            raise self._failure("ended")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SpecstackError(f"llama-cpp-python: {reply['error']}")
        return reply

    def _failure(self, what: str) -> SpecstackError:
        deadline = time.monotonic() + 5
        while self.proc.poll() is None and time.monotonic() < deadline:  # the pipe closes just before the exit
            time.sleep(0.05)
        code, tail = self.proc.poll(), children.log_tail(self.log)
        hint = REBUILD_HINT if code is not None and -code in (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS) else ""
        return SpecstackError(f"llama-cpp-python's process {children.ended(self.proc) or what}"
                              + (f": {tail}" if tail else "") + hint)


def serve() -> None:
    """The child: a `load` line, then one `generate` line after another, until stdin closes."""
    from specstack.bench.peers import llama_cpp_generate, load_llama_cpp
    from specstack.models.registry import resolve

    out = os.fdopen(os.dup(1), "w")  # the replies' own descriptor; whatever the library prints goes to stderr
    os.dup2(2, 1)
    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "load" in request:
                llm = load_llama_cpp(resolve(request["load"]), request["threads"], request["n_ctx"],
                                     prompt_lookup=request["prompt_lookup"])
                if llm is None:
                    raise SpecstackError("llama-cpp-python cannot load this model here (see its log)")
                reply: dict[str, Any] = {"ok": True}
            else:
                assert llm is not None, "a generate before the load"
                sampling = SamplingParams(**request["sampling"])
                reply = {"tokens": llama_cpp_generate(llm, request["ids"], request["n"], sampling)}
        except (SpecstackError, ValueError, OSError) as e:
            reply = {"error": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
