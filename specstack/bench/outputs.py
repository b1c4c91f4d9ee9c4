"""What a method of `specstack bench` yields for one prompt (Output) and the callable that yields it
(Runner: prompt ids, n -> Output, everything it needs loaded up front): shared by the engine's runners
(bench/run.py) and the peers' (bench/peer_runners.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Output:
    tokens: list[int]
    dtype: str  # the weight format it ran in
    target_forwards: int | None = None
    tau: float | None = None
    origins: dict[str, int] | None = None
    phases: dict[str, float] | None = None
    accepted_per_step: list[int] | None = None
    token_origins: list[str] | None = None
    drafted: int | None = None  # draft tokens proposed (a peer's acceptance rate is accepted / drafted)


Runner = Callable[[list[int], int], Output]
