"""The rules for numbers and sizes that every entry point shares (the command line now, the HTTP server
to come): each rule is written once, here, and fails with a SpecstackError whose one line names the
field and says what is wrong.

A rule takes the field's name as its caller spells it (`--top-p` on the command line, `top_p` in a
dataclass or a request) and the value as given: an int or a float, or the text of a flag. Booleans
are not numbers here, and a float is not an integer (a request's `4.0` for a count is refused, not
truncated). Foundation layer: no torch, no argparse.

Upper bounds come from what can be used: the engine verifies at most MAX_TREE draft tokens per step,
so no draft size beyond it can ever be verified; a model's context bounds positions (fits_context,
once the model's config is known; MAX_CONTEXT before that); a seed is 64 bits. Where nothing finer
is known a bound is a sanity cap (MAX_COUNT, MAX_REPEATS), far above any real run, so that a typo of
a few extra digits fails at once instead of allocating or running for hours.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

from specstack.errors import SpecstackError

T = TypeVar("T")
Rule = Callable[[str, object], T]  # (field name, value as given) -> the checked value

# ---------------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------------
# Draft tokens the target verifies per step at most (engine/speculative.py sizes its scratch by it and
# truncates every proposal to it): a chain, a tree's budget, depth or width beyond it is never verified.
MAX_TREE = 64
VERIFIED = f"the target verifies at most {MAX_TREE} draft tokens per step"
# Positions before a model is known (tokens to generate, a context to measure at): no model specstack
# runs has a longer context; once the model's config is read, fits_context checks against its own.
MAX_CONTEXT = 1 << 22
SEED_MAX = 2**64 - 1  # torch's generators take 64-bit seeds
# llama.cpp's thread limit (GGML_MAX_N_THREADS); torch shares the thread count in every benchmark
MAX_THREADS = 512
# float32 logits divided by a smaller temperature overflow to inf (and the warp to NaN); well above
# that edge, far below any temperature that is not greedy in all but name
MIN_TEMPERATURE = 1e-30
TOP_K_MAX = 2**31 - 1  # a C int where peers (llama.cpp) read it; any k >= the vocabulary keeps every token
MAX_COUNT = 1_000_000  # prompts, sequences, optimizer steps
MAX_REPEATS = 1000  # repeats and warm-ups of one measurement
# Rows decoding at once at most: each takes a KV-cache row of its whole context, allocated up front, so
# a typo of a few extra digits would allocate gigabytes
MAX_BATCH_SIZE = 1024


# ---------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------
def fail(name: str, problem: str) -> NoReturn:
    raise SpecstackError(f"{name} {problem}")


def shown(value: object, limit: int = 40) -> str:
    """A value for an error message: its repr, cut short (a flag may hold a megabyte of digits)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def integer(name: str, value: object) -> int:
    """An int, or the decimal text of one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            if text.lstrip("+-").isdigit():  # an integer that int() refuses: over 4300 digits
                fail(name, f"is far too large ({len(text)} digits)")
    fail(name, f"must be an integer, got {shown(value)}")


def number(name: str, value: object) -> float:
    """A finite float from an int, a float or the text of one."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        fail(name, f"must be a number, got {shown(value)}")
    try:
        x = float(value)
    except (ValueError, OverflowError):
        fail(name, f"must be a number, got {shown(value)}")
    if not math.isfinite(x):
        fail(name, f"must be a finite number, got {shown(value)}")
    return x


def bounded_int(name: str, value: object, low: int, high: int | None = None, why: str = "") -> int:
    """An integer in [low, high] (high None: no upper bound); why: what makes `high` the limit."""
    n = integer(name, value)
    if low <= n and (high is None or n <= high):
        return n
    reason = f" ({why})" if why else ""
    if high == low + 1:
        fail(name, f"is {low} or {high}, got {n}{reason}")
    if n < low:
        fail(name, f"must be >= {low}, got {n}")
    fail(name, f"must be <= {high}, got {n}{reason}")


def bounded_float(name: str, value: object, low: float, high: float | None = None, *, low_open: bool = False) -> float:
    """A finite float in [low, high] ((low, high] when low_open; high None: no upper bound)."""
    x = number(name, value)
    below = x <= low if low_open else x < low
    if below or (high is not None and x > high):
        if high is None:
            fail(name, f"must be {'>' if low_open else '>='} {low:g}, got {x:g}")
        fail(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {x:g}")
    return x


def ints(low: int, high: int | None = None, why: str = "") -> Rule[int]:
    """bounded_int with fixed bounds, as a rule."""
    return lambda name, value: bounded_int(name, value, low, high, why)


def floats(low: float, high: float | None = None, *, low_open: bool = False) -> Rule[float]:
    """bounded_float with fixed bounds, as a rule."""
    return lambda name, value: bounded_float(name, value, low, high, low_open=low_open)


def fits_context(what: str, needed: int, max_seq_len: int) -> None:
    """`what` needs `needed` positions of a model whose context is max_seq_len tokens."""
    if needed > max_seq_len:
        raise SpecstackError(f"{what}: {needed} positions, over the model's context of {max_seq_len} tokens")


# ---------------------------------------------------------------------------------------------------
# The shared fields
# ---------------------------------------------------------------------------------------------------
def new_tokens(name: str, value: object) -> int:
    """Tokens to generate: at least one; the model's context caps a generation once it is known."""
    return bounded_int(name, value, 1, MAX_CONTEXT, "longer than any model's context")


def temperature(name: str, value: object) -> float:
    """0 (greedy) or a positive temperature that does not overflow the scaled logits."""
    t = bounded_float(name, value, 0.0)
    if 0 < t < MIN_TEMPERATURE:
        fail(name, f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (a smaller one overflows the scaled logits), "
                   f"got {t:g}")
    return t


def top_k(name: str, value: object) -> int:
    return bounded_int(name, value, 0, TOP_K_MAX, "a C int; any k from the vocabulary's size up keeps every token")


def top_p(name: str, value: object) -> float:
    return bounded_float(name, value, 0.0, 1.0, low_open=True)


def seed(name: str, value: object) -> int:
    return bounded_int(name, value, 0, SEED_MAX, "seeds are 64-bit")


def stop_string(name: str, value: object) -> str:
    if not isinstance(value, str):
        fail(name, f"must be text, got {shown(value)}")
    if not value:
        raise SpecstackError(f"{name}: an empty stop string would stop at once")
    return value


def threads(name: str, value: object) -> int:
    return bounded_int(name, value, 1, MAX_THREADS, "llama.cpp's limit")


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def threads_warning(name: str, n: int | None) -> str | None:
    """A warning when `n` threads is more than the cores (allowed: it only slows a run, badly)."""
    cores = available_cores()
    if n is None or n <= cores:
        return None
    return (f"{name} {n} is more than the {cores} CPU cores available: the threads contend and the run "
            "can be many times slower")
