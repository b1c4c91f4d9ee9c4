"""Incremental detokenisation with stop strings and EOS, shared by every generation loop.

Engines push the tokens they emit (one at a time or several after a verification); the stream
decides when to stop and which text is safe to show: text that might still turn out to be the start
of a stop string is held back until it is known not to be.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

FinishReason = Literal["eos", "stop", "length"]


class TokenStream:
    def __init__(self, tokenizer: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), on_text: Callable[[str], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.on_text = on_text
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._shown = 0  # characters of the decoded text already passed to on_text
        self._text = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def push(self, tokens: Iterable[int]) -> int:
        """Append emitted tokens until a stop condition; returns how many were taken."""
        taken = 0
        for t in tokens:
            if self.done:
                break
            taken += 1
            if t in self.eos_ids:
                self.finish_reason = "eos"
                break
            self.tokens.append(int(t))
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
        self._update_text()
        return taken

    def _update_text(self) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=False)
        hold = 0
        for s in self.stop_strings:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
                self.finish_reason = "stop"
        if not self.done:
            # an incomplete multi-byte character decodes to U+FFFD: wait for the rest of it
            while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
                hold += 1
            for s in self.stop_strings:  # a suffix that may become a stop string is held back
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        self._text = text
        safe = len(text) - hold
        if self.on_text is not None and safe > self._shown:
            self.on_text(text[self._shown : safe])
            self._shown = safe
