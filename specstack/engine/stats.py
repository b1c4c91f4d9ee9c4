"""Run statistics as data (DESIGN §2.7); reports are built from these."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # forwards of the target after prefill
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward (prefill counts as the first forward)."""
        return self.new_tokens / max(1, self.target_forwards + 1)

    def line(self) -> str:
        return (f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tokens/s; "
                f"prefill {self.prompt_tokens} tokens {self.prefill_seconds:.2f} s)")
