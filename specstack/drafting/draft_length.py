"""BASS's dynamic draft length (Qian et al. 2024; DESIGN §6), for one sequence or a batch.

Start at `l = start`. After each verification, if some row accepted all `l` drafts the draft was too
short: `l = min(l + 2, cap)`, `s = 0`. Otherwise shrink towards what was accepted:
`l = max(1, max_i accepted_i, l - ceil(l / 10) - s)`, `s = 1` (a second miss in a row shrinks one more).

Why it pays for a chain: a verification forward costs more with every token it scores (on an int4
CPU target about 17 % of a one-token step per extra token), and n-gram drafts are bimodal: on code a
context match is usually right for many tokens in a row, elsewhere the first guess is usually wrong.
A fixed length wastes tokens in the second case and stops too early in the first.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DynamicDraftLength:
    start: int = 7
    cap: int = 32
    value: int = field(init=False)
    _shrink: int = field(init=False, default=0)  # s: 1 after a step in which no row accepted all

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.cap:
            raise ValueError(f"draft length: need 1 <= start <= cap, got start {self.start}, cap {self.cap}")
        self.reset()

    def reset(self) -> None:
        self.value, self._shrink = self.start, 0

    def update(self, accepted: Sequence[int]) -> int:
        """Accepted draft tokens of every row in the step just verified (each proposed `value`
        tokens, or fewer where a row ran out of proposals); returns the next length."""
        l = self.value
        if any(a >= l for a in accepted):
            self.value, self._shrink = min(l + 2, self.cap), 0
        else:
            self.value = max(1, max(accepted, default=0), l - math.ceil(l / 10) - self._shrink)
            self._shrink = 1
        return self.value
