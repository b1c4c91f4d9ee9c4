"""A peer library in a process of its own (llama-cpp-python for `llamacpp`/`llamacpp-pld`, OpenVINO GenAI
for the `openvino` peers of `specstack bench`): a native library that crashes (a segfault in decode, as
llama.cpp's AMX builds do on some Xeons) or hangs takes only this process down, and the bench reports the
peer as failed and goes on (bench/run.py).

The parent (`PeerChild`) starts `python -m specstack.bench.peer_child` through bench/children.py (its own
process group, gone with the bench) and talks to it in JSON lines over its stdin/stdout: one `load` (the
library, then what that library's loader takes), answered with what was loaded (`about`: the library's
version and build), then `generate` requests (token ids, n, the sampling settings), each answered with
the tokens or an error. The bench times the request round trip, a pipe's microseconds beside a
generation's seconds. The child's stderr goes to a log whose last lines a failure quotes.

LIBRARIES is the table the child loads from: a library's name -> the module that implements it, whose
`load(**request) -> (model, about)` and `generate(model, ids, n, sampling) -> tokens` the child calls.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench import children
from specstack.bench.llama_server import request_timeout
from specstack.config import SamplingParams
from specstack.errors import SpecstackError

LOAD_TIMEOUT_S = 300.0
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS)


def _llama_cpp_hint() -> str:
    from specstack.bench.llama_build import rebuild_llama_cpp_python

    # a native build that crashes: most often one that turned AMX on (llama.cpp's AMX code segfaults on some
    # of our Xeons) or an instruction set the CPU lacks
    return f"; rebuild llama-cpp-python for this CPU with AMX off: {rebuild_llama_cpp_python()}"


# library -> (the module with its load/generate, what a crash of it suggests)
LIBRARIES: dict[str, tuple[str, Callable[[], str]]] = {
    "llama-cpp-python": ("specstack.bench.llama_cpp_peer", _llama_cpp_hint),
    "openvino-genai": ("specstack.bench.openvino_peer", lambda: ""),
}


class PeerChild:
    """One model of a peer library in a child process; `about` says what was loaded (version, build)."""

    def __init__(self, library: str, **load: Any) -> None:
        self.library = library
        self.log = Path(tempfile.mkstemp(prefix=f"{library}-", suffix=".log")[1])
        with open(self.log, "wb") as err:
            self.proc = children.start([sys.executable, "-m", "specstack.bench.peer_child"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.about: str = self._ask({"library": library, "load": load}, LOAD_TIMEOUT_S)["about"]

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
            raise SpecstackError(f"{self.library} did not answer within {timeout:.0f} s (SPECSTACK_PEER_TIMEOUT_S "
                                 "sets the limit)")
        line = self.proc.stdout.readline()
        if not line:
            raise self._failure("ended")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SpecstackError(f"{self.library}: {reply['error']}")
        return reply

    def _failure(self, what: str) -> SpecstackError:
        how = children.ended_soon(self.proc)
        code, tail = self.proc.poll(), children.log_tail(self.log)
        hint = LIBRARIES[self.library][1]() if code is not None and -code in CRASH_SIGNALS else ""
        return SpecstackError(f"{self.library}'s process {how or what}"
                              + (f": {tail}" if tail else "") + hint)


def serve() -> None:
    """The child: a `load` line, then one `generate` line after another, until stdin closes."""
    out = os.fdopen(os.dup(1), "w")  # the replies' own descriptor; whatever the library prints goes to stderr
    os.dup2(2, 1)
    library: Any = None
    model: Any = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "load" in request:
                library = importlib.import_module(LIBRARIES[request["library"]][0])
                model, about = library.load(**request["load"])
                reply: dict[str, Any] = {"about": about}
            else:
                assert model is not None, "a generate before the load"
                reply = library.generate(model, request["ids"], request["n"], SamplingParams(**request["sampling"]))
        except (SpecstackError, ValueError, OSError, RuntimeError) as e:
            reply = {"error": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
