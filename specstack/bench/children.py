"""Processes the bench starts (llama-server, llama-bench, llama-batched-bench): each in a process group
of its own, stopped with its whole group, and gone when the bench is gone however it ends.

A normal end or an exception stops a server through its owner's `close` (`stop` here: SIGTERM to the
group, SIGKILL after a grace period). Ctrl-C, SIGTERM or a crash (kill -9) of the bench leave no
`finally` to run, so the child is started under util-linux's `setpriv --pdeathsig TERM`, which asks
Linux (PR_SET_PDEATHSIG) to send it SIGTERM when the thread that started it dies, then execs it: no
Python runs between fork and exec (a `preexec_fn` is unsafe beside the bench's threads). Where setpriv
is missing (not Linux), the child starts without it and only the paths with a `finally` stop it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GRACE_S = 10.0  # from SIGTERM to SIGKILL


def guarded(argv: Sequence[str]) -> list[str]:
    """argv run so that it receives SIGTERM when its parent dies (as it is where setpriv is missing)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


def start(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Popen(argv) in a new process group (session), dying with this process."""
    return subprocess.Popen(guarded(argv), start_new_session=True, **kwargs)


def run(argv: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """subprocess.run(argv) (text, output captured) in a new process group, dying with this process; on
    a timeout its whole group is killed before TimeoutExpired goes on."""
    with subprocess.Popen(guarded(argv), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop(proc, grace_s=0)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop(proc: subprocess.Popen[Any], grace_s: float = GRACE_S) -> None:
    """Stop proc's process group: SIGTERM, then SIGKILL if it has not exited within grace_s."""
    if proc.poll() is not None:
        return
    _signal_group(proc, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s if grace_s > 0 else None)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def ended(proc: subprocess.Popen[Any]) -> str | None:
    """How proc ended, as a report says it ("was killed by SIGSEGV", "exited with 3"); None while it runs."""
    code = proc.poll()
    if code is None:
        return None
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def ended_soon(proc: subprocess.Popen[Any], wait: float = 5.0) -> str | None:
    """How proc ended, waiting up to `wait` seconds for it: a crashing process closes its pipes and
    sockets just before its exit status can be read, so a peer seen to drop its connection is given
    that moment before the report says how it ended."""
    deadline = time.monotonic() + wait
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return ended(proc)


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a child's log, joined for one line of a report ("" when unreadable)."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group's id is the child's pid
    except ProcessLookupError:
        pass
