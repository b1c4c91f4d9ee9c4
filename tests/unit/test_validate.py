"""specstack/validate.py: the shared rules for numbers and sizes, as the command line and (to come) the
server apply them: a value as given (int, float or text), one SpecstackError line naming the field."""
from __future__ import annotations

import subprocess
import sys

import pytest

import specstack.validate as v
from specstack.errors import SpecstackError


@pytest.mark.parametrize("value, expected", [(7, 7), ("7", 7), (" -3 ", -3), ("+12", 12), (2**80, 2**80)])
def test_integers_from_ints_and_their_text(value, expected):
    assert v.integer("n", value) == expected


@pytest.mark.parametrize("value, message", [
    (True, "n must be an integer, got True"),  # a bool is not a count
    (4.0, "n must be an integer, got 4.0"),  # nor is a float, integral or not (a request's 4.0)
    ("1e3", "n must be an integer, got '1e3'"),
    (None, "n must be an integer, got None"),
    ("9" * 5000, "n is far too large (5000 digits)"),  # int() refuses it: said as what it is
    ("x" * 500, "n must be an integer, got '" + "x" * 39 + "..."),  # the value shown, cut short
])
def test_what_is_not_an_integer(value, message):
    with pytest.raises(SpecstackError) as e:
        v.integer("n", value)
    assert str(e.value) == message or str(e.value).startswith(message)


@pytest.mark.parametrize("value, message", [
    ("nan", "x must be a finite number, got 'nan'"), (float("inf"), "x must be a finite number, got inf"),
    ("x", "x must be a number, got 'x'"), (False, "x must be a number, got False"),
    (10**400, "x must be a number, got 1000"),  # too large for a float
])
def test_what_is_not_a_finite_number(value, message):
    with pytest.raises(SpecstackError) as e:
        v.number("x", value)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("args, message", [
    ((0, 1, 64), "k must be >= 1, got 0"),
    ((65, 1, 64, "why"), "k must be <= 64, got 65 (why)"),
    ((2, 0, 1, "why"), "k is 0 or 1, got 2 (why)"),
    ((-1, 0, None), "k must be >= 0, got -1"),
])
def test_bounded_int_names_the_bound_it_broke(args, message):
    with pytest.raises(SpecstackError) as e:
        v.bounded_int("k", *args)
    assert str(e.value) == message
    assert v.bounded_int("k", "64", 1, 64) == 64 and v.bounded_int("k", 10**30, 0) == 10**30


def test_bounded_float_open_and_closed_ends():
    assert v.bounded_float("p", "1", 0.0, 1.0, low_open=True) == 1.0
    for value, message in ((0, "p must be in (0, 1], got 0"), (1.5, "p must be in (0, 1], got 1.5")):
        with pytest.raises(SpecstackError, match=r"^" + message.replace("(", r"\(").replace("]", r"\]") + "$"):
            v.bounded_float("p", value, 0.0, 1.0, low_open=True)
    with pytest.raises(SpecstackError, match=r"^t must be >= 0, got -1$"):
        v.bounded_float("t", -1, 0.0)
    assert v.floats(0.0, 1.0)("w", "0") == 0.0 and v.ints(1, 3)("n", "3") == 3


def test_the_shared_fields():
    assert v.seed("--seed", str(v.SEED_MAX)) == 2**64 - 1
    with pytest.raises(SpecstackError, match="--seed must be <= 18446744073709551615, got 18446744073709551616"):
        v.seed("--seed", 2**64)
    assert v.temperature("t", 0) == 0 and v.temperature("t", v.MIN_TEMPERATURE) == v.MIN_TEMPERATURE
    with pytest.raises(SpecstackError, match="must be 0 \\(greedy\\) or >= 1e-30"):
        v.temperature("t", 1e-31)
    assert v.new_tokens("n", v.MAX_CONTEXT) == v.MAX_CONTEXT
    with pytest.raises(SpecstackError, match="--stop: an empty stop string would stop at once"):
        v.stop_string("--stop", "")
    assert v.stop_string("--stop", "\n\n") == "\n\n"
    assert v.threads("--threads", "2") == 2


def test_fits_context():
    v.fits_context("w", 64, 64)
    with pytest.raises(SpecstackError, match="^w: 65 positions, over the model's context of 64 tokens$"):
        v.fits_context("w", 65, 64)


def test_more_threads_than_cores_is_a_warning_not_an_error(monkeypatch):
    monkeypatch.setattr(v, "available_cores", lambda: 2)
    assert v.threads_warning("--threads", None) is None and v.threads_warning("--threads", 2) is None
    assert v.threads_warning("--threads", 3).startswith("--threads 3 is more than the 2 CPU cores available")


def test_validate_imports_neither_torch_nor_argparse():
    """The server will apply these rules to requests: no argparse, and cheap (no torch)."""
    code = "import sys, specstack.validate; print(sorted(m for m in ('torch', 'argparse') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"
