"""The one small interface benchmarks/grammar/engines.py measures each grammar engine through: an `Engine`
compiles a case's grammar into a `Matcher` (fill the next-token bitmask, accept, roll back, forced tokens)
and applies a bitmask to logits."""
from __future__ import annotations

from typing import Protocol

import torch
from grammar_cases import Case

VOCAB = 151_936  # Qwen2.5-Coder's logits width (the tokenizer pads its table to it)


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor) -> None: ...
    def accept(self, token: int) -> bool: ...
    def accept_many(self, tokens: list[int]) -> bool: ...
    def rollback(self, k: int) -> None: ...
    def forced_tokens(self) -> list[int]: ...
    def forced_bytes(self) -> bytes: ...
    def reset(self) -> None: ...
    def error(self) -> str | None: ...


class Engine(Protocol):
    name: str
    def compile(self, case: Case) -> Matcher: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


def dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)
