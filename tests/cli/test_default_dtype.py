"""The default weight format follows the CPU (specstack/cli/common.py, default_dtype): w4a8 where its
native kernels load (exact, and the fastest one-token step there), int4 where they do not (no AVX2, no
compiler, a failed build), bf16 on CUDA; a --dtype given is always what runs."""
from __future__ import annotations

import argparse

from specstack.cli import common
from specstack.models import native


def test_w4a8_where_its_kernels_load_and_int4_where_they_do_not(monkeypatch):
    assert common.default_dtype("cpu") == ("w4a8" if native.load("w4a8") else "int4")
    monkeypatch.setattr(native, "load", lambda name: False)  # a CPU without AVX2, or no compiler
    assert common.default_dtype("cpu") == "int4"
    monkeypatch.setattr(native, "load", lambda name: True)
    assert common.default_dtype("cpu") == "w4a8"
    assert common.default_dtype("cuda") == "bf16"


def test_a_given_dtype_is_what_runs(monkeypatch):
    monkeypatch.setattr(native, "load", lambda name: True)
    args = argparse.Namespace(model=common.DEFAULT_MODEL, threads=None, device="cpu", dtype="int4")
    assert common.check_model_args(args) == "int4"
    args.dtype = None
    assert common.check_model_args(args) == "w4a8"
    assert "w4a8 where this CPU has its native kernels" in common.DTYPE_HELP
