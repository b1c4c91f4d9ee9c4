"""Modules whose forward is a closure over their current tensors.

A one-token decode step of the default model calls ~120 linears and 61 norms. Through nn.Module each
call looks its weights up in `_parameters` / `_buffers` (`Module.__getattr__`, microseconds each) and
re-decides its kernel; bound once, a linear's call costs only its kernel, which took a visible share
off a one-token step (docs/bench-history, "Wide forwards on dense weights, bound layers"). The
closure is dropped whenever the tensors may be replaced: `.to()` / `.float()` / `.cuda()` (`_apply`),
`load_state_dict`, copying and pickling; a subclass calls `unbind()` when a setting the closure
captured changes. In-place writes to the tensors (`copy_`) need nothing: the closure holds the
tensors themselves.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Forward = Callable[[torch.Tensor], torch.Tensor]


class BoundModule(nn.Module):
    _bound: Forward | None = None

    def bind(self) -> Forward:
        """The forward as a closure over this module's tensors (subclasses)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self._bound
        if run is None:
            run = self._bound = self.bind()
        return run(x)

    def unbind(self) -> None:
        self._bound = None

    def _apply(self, fn: Any, recurse: bool = True) -> BoundModule:
        self.unbind()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.unbind()
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_bound", None)  # a copy binds to its own tensors
        return state
