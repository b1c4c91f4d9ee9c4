"""Ctrl-C as a request to stop at the next step, not an exception wherever the main thread happens to be.

Python's default SIGINT handler raises KeyboardInterrupt at whatever bytecode runs next; when that is
a finaliser (`__del__`, e.g. in a tokenizer's regex module) or a C callback, the exception is printed
("Exception ignored ...") and swallowed, and the run goes on. So the command line installs
`handling_sigint()`: a Ctrl-C only sets a flag, and the main loops call `check()` once per step (every
engine step, bench generation, training step and teacher batch), which raises KeyboardInterrupt there,
at a safe point; the CLI turns it into exit 130. A second Ctrl-C while the first is still pending raises
at once, for the long phases with no step to check (loading a model).

Without the handler (library use) nothing changes: no Ctrl-C ever sets the flag, so `check()` is one
flag read, and Python's default behaviour stays.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_requested = False


def request() -> None:
    """Ask the running loop to stop at its next `check()` (what the handler does on Ctrl-C)."""
    global _requested
    _requested = True


def requested() -> bool:
    return _requested


def clear() -> None:
    global _requested
    _requested = False


def check() -> None:
    """The per-step safe point: raise KeyboardInterrupt if a stop was requested."""
    if _requested:
        raise KeyboardInterrupt


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _requested:  # the second Ctrl-C: the user will not wait for the next step
        raise KeyboardInterrupt
    request()


@contextmanager
def handling_sigint() -> Iterator[None]:
    """While inside: Ctrl-C sets the flag (see the module docstring); on leaving, the previous handler
    is back and the flag cleared. Nested inside itself it does nothing (the outer one keeps a pending
    Ctrl-C and restores); so it does in a thread other than the main one, where no handler can be
    installed (a command run from a worker thread)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is _on_sigint):
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    clear()
    try:
        yield
    finally:
        # None: the handler was installed outside Python; the default is the closest we can restore
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        clear()
