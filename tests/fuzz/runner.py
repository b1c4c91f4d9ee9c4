"""Running one command line of a case: in-process through `specstack.cli.entry.main` (the working folder,
argv, cache, threads and signal handlers restored after it; a time bound; an address-space cap) or as
`python -m specstack.cli` in a subprocess; either gives an `Outcome`."""
from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.fixtures import cache_env

CASE_SECONDS = 20.0  # the time bound of one case (every valid case here runs in about a second)
MEMORY_HEADROOM = 4 << 30  # address space a case may add: an unbounded allocation fails instead of swapping


class Stop(BaseException):
    """Raised into a case by the harness (a BaseException: `except Exception` in the code under test
    lets it through). kind: the failure it stands for."""

    kind = "harness stop"


class CaseTimeout(Stop):
    kind = "hang"


class TooManyThreads(Stop):
    """torch.set_num_threads(N) above THREADS_CAP: a process may not survive it (100000 threads
    segfault Python here), and in-process that would end the whole fuzz run."""

    kind = "unbounded thread count"


THREADS_CAP = 512  # the most --threads specstack accepts (validate.MAX_THREADS)


@dataclass
class Outcome:
    code: int | None  # None: main did not return
    out: str
    err: str
    seconds: float
    escaped: str | None = None  # the exception that escaped main: "Type at file:line in function"
    message: str = ""  # its message
    stopped: str | None = None  # the Stop kind that ended the case


def describe(e: BaseException) -> tuple[str, str]:
    """(type and the innermost specstack frame, the message) of an exception."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if f"{os.sep}specstack{os.sep}" in f.filename]
    where = own[-1] if own else (frames[-1] if frames else None)
    at = ""
    if where is not None:
        name = where.filename
        at = f" at {name[name.rfind(os.sep + 'specstack' + os.sep) + 1:] if own else name}:{where.lineno} in {where.name}"
    return f"{type(e).__name__}{at}", " ".join(str(e).split())[:300]


def _stream(errors: str) -> io.TextIOWrapper:
    """A captured stdout/stderr that encodes as the real ones do (UTF-8; stdout strict, stderr
    backslashreplace), with a .buffer."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", "backslashreplace")


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout into the block after `seconds` (main thread only; elsewhere the time is only
    measured)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_sig: int, _frame: Any) -> None:
        raise CaseTimeout(f"no answer within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def _process_state(argv: Sequence[str], ws: Path, cache: Path) -> Iterator[None]:
    """What a case may change in this process, restored after it: the working folder, sys.argv, the
    environment's cache, torch's thread count (one to start with; guarded), the SIGINT handler,
    warning filters."""
    import warnings

    import torch

    cwd, sys_argv = os.getcwd(), sys.argv
    sigint = signal.getsignal(signal.SIGINT)
    real_set, threads = torch.set_num_threads, torch.get_num_threads()

    def set_num_threads(n: int) -> None:
        if isinstance(n, int) and n > THREADS_CAP:
            raise TooManyThreads(f"torch.set_num_threads({n})")
        real_set(n)

    os.chdir(ws)
    sys.argv = ["specstack", *argv]
    real_set(1)  # tiny models: one thread is as fast, and kinder to a shared machine
    torch.set_num_threads = set_num_threads
    try:
        with warnings.catch_warnings(), cache_env(cache):
            yield
    finally:
        torch.set_num_threads = real_set
        real_set(threads)
        signal.signal(signal.SIGINT, sigint)
        sys.argv = sys_argv
        os.chdir(cwd)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        kb = next((int(line.split()[1]) for line in f if line.startswith("VmSize:")), 0)
    return kb * 1024


@contextmanager
def memory_cap(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Cap this process's address space at its present size plus `headroom`: an allocation sized by an
    unbounded input fails (a MemoryError, reported) instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_in_process(argv: Sequence[str], ws: Path, cache: Path, seconds: float = CASE_SECONDS) -> Outcome:
    """`specstack ARGV` through specstack.cli.entry.main in this process, in the folder `ws`."""
    from specstack.cli.entry import main

    out, err = _stream("strict"), _stream("backslashreplace")
    code, escaped, message, stopped = None, None, "", None
    start = time.perf_counter()
    with _process_state(argv, ws, cache), redirect_stdout(out), redirect_stderr(err):
        try:
            with _alarm(seconds):
                code = main(list(argv))
        except Stop as e:
            stopped, message = e.kind, str(e)
        except BaseException as e:  # noqa: B036 -- whatever escapes main is the traceback a user sees
            escaped, message = describe(e)
    return Outcome(code, _text(out), _text(err), time.perf_counter() - start, escaped, message, stopped)


def run_subprocess(argv: Sequence[str], ws: Path, cache: Path, seconds: float = CASE_SECONDS) -> Outcome:
    """`python -m specstack.cli ARGV` in the folder `ws`: the real entry point, end to end."""
    env = dict(os.environ, SPECSTACK_CACHE=str(cache))
    start = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "specstack.cli", *argv], cwd=ws, env=env, capture_output=True,
                           timeout=seconds)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode("utf-8", "backslashreplace")
        return Outcome(None, "", err, time.perf_counter() - start, stopped=CaseTimeout.kind,
                       message=f"no answer within {seconds:.0f} s")
    return Outcome(p.returncode, p.stdout.decode("utf-8", "backslashreplace"),
                   p.stderr.decode("utf-8", "backslashreplace"), time.perf_counter() - start)
