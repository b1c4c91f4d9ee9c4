"""A table of kernels for one arithmetic, one chosen per process from what the device offers.

Each entry says where it applies; the first that applies is used, unless an environment variable
names one (tests simulate a CPU without the fast path that way). Every entry of a table computes the
same format: the fast ones are checked against the table's reference.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from specstack.errors import SpecstackError

Kernel = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] fp32 -> y [M, N] fp32 (no bias)
Build = TypeVar("Build")


@dataclass(frozen=True)
class KernelChoice(Generic[Build]):
    name: str
    applies: Callable[[torch.device], bool]
    build: Build  # a linear's kernels: the layer's stored tensors -> its Kernel


LinearKernels = KernelChoice[Callable[..., Kernel]]


def choose(kernels: tuple[KernelChoice[Build], ...], force_env: str, device: torch.device) -> KernelChoice[Build]:
    """The kernel to use on `device`: the one `force_env` names (refused where it does not apply), else
    the first that applies (the last entry, the reference, applies everywhere)."""
    forced = os.environ.get(force_env) or None
    if forced is not None and forced not in {k.name for k in kernels}:
        raise SpecstackError(f"{force_env}={forced!r}: choose from {', '.join(k.name for k in kernels)}")
    for k in kernels:
        if forced and k.name == forced:
            if not k.applies(device):  # never run instructions the CPU lacks (that is a crash, not an error)
                raise SpecstackError(f"{force_env}={forced!r}: this {device.type} cannot run it; here: "
                                     + ", ".join(c.name for c in kernels if c.applies(device)))
            return k
        if not forced and k.applies(device):
            return k
    raise AssertionError("a table's last kernel applies everywhere")
