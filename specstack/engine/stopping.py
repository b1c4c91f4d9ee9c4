"""Incremental detokenisation with stop strings, EOS and an editor's stops, shared by every generation
loop.

Engines push the tokens they emit (one at a time or several after a verification), each with its origin
(who proposed it: the target, a draft, draft2, the context); the stream decides when to stop and which
text is safe to show: text that might still turn out to be the start of a stop string is held back until
it is known not to be. A stream asked for spans also says which token (and so which origin) each piece
of released text came from, for views that colour the text as it arrives (the server's page).

The text is decoded incrementally (engine/detokenize.py) and a push searches for stop strings only in
the text that could have changed since the last one, with each stop string's length less one before it:
a push costs the tokens it brings, not the whole answer.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from specstack.config import EditorStops
from specstack.engine.detokenize import REPLACEMENT, IncrementalDetokenizer
from specstack.processing import TokenLogprob

FinishReason = Literal["eos", "stop", "length"]
Span = tuple[str, str]  # (text, origin of the token that added it)


class TokenStream:
    def __init__(self, tokenizer: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                 editor: EditorStops | None = None, on_spans: Callable[[list[Span]], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.on_text = on_text
        self.editor = editor
        self.on_spans = on_spans
        self.tokens: list[int] = []
        self.origins: list[str] = []  # who proposed each token
        self.logprobs: list[TokenLogprob] = []  # each token's log-probability, when the engine reads them
        self.finish_reason: FinishReason | None = None
        self.stop_word: str | None = None  # the stop string that ended the text
        self._shown = 0  # characters of the decoded text already passed to on_text
        self._text = ""
        self._detok = IncrementalDetokenizer(tokenizer)
        self._ends: list[int] = []  # with on_spans: the text's length after each token
        # with on_spans: tokens before _span_from end at or before the text already shown (their prefix
        # maximum is _span_low), so no later span comes from them
        self._span_from = 0
        self._span_low = 0
        self._started: float | None = None  # when the first token arrived (an editor's time limit counts from it)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def push(self, tokens: Iterable[int], origins: Sequence[str] | None = None,
             logprobs: Sequence[TokenLogprob] | None = None) -> int:
        """Append emitted tokens until a stop condition; returns how many were taken. `origins`: who
        proposed each (default: the target); `logprobs`: each one's log-probability (kept with it)."""
        if self._started is None:
            self._started = time.perf_counter()
        if self.done:  # nothing is taken, and the text, its cut and what was shown stay as they are
            return 0
        taken = 0
        before = len(self._text)
        searched = self._detok.stable  # text the last push searched that no token can change
        for j, t in enumerate(tokens):
            if self.done:
                break
            taken += 1
            if t in self.eos_ids:
                self.finish_reason = "eos"
                break
            self.tokens.append(int(t))
            self.origins.append(origins[j] if origins is not None else "target")
            if logprobs is not None:
                self.logprobs.append(logprobs[j])
            if self.on_spans is not None:
                self._detok.update(self.tokens)
                self._ends.append(len(self._detok))
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
        if self.on_spans is None:
            self._detok.update(self.tokens)
        self._update_text(before, min(searched, self._detok.stable))
        return taken

    def _update_text(self, before: int, searched: int) -> None:
        """`searched`: the text's first characters that the last push searched for stop strings and that
        did not change since; a stop string found now starts at most its length less one before them."""
        if self.tokenizer is None:
            return
        text = self._detok.text
        hold = 0
        for s in self.stop_strings:
            at = text.find(s, max(0, searched - len(s) + 1))
            if at >= 0:
                text = text[:at]
                self.finish_reason, self.stop_word = "stop", s
        if self.editor is not None and self.finish_reason != "stop":
            cut = self.editor.cut(text, time.perf_counter() - (self._started or 0.0), text[before:])
            if cut is not None:
                text = text[:cut]
                self.finish_reason = "length"
        if not self.done:
            # an incomplete multi-byte character decodes to U+FFFD: wait for the rest of it
            while hold < len(text) and text[len(text) - hold - 1] == REPLACEMENT:
                hold += 1
            for s in self.stop_strings:  # a suffix that may become a stop string is held back
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        self._text = text
        safe = len(text) - hold
        if safe > self._shown:
            if self.on_spans is not None:
                self.on_spans(self._spans(self._shown, safe))
            if self.on_text is not None:
                self.on_text(text[self._shown : safe])
            self._shown = safe

    def _spans(self, start: int, end: int) -> list[Span]:
        """text[start:end] cut where each token's text ends, each piece with its token's origin. A token
        that ends inside a multi-byte character (whose prefix decodes longer than it will be) is clamped,
        so the pieces always join to exactly the released text."""
        last = len(self._ends) - 1
        # tokens that end at or before `start` add nothing now or later (starts only grow): skip them once
        while self._span_from < last and max(self._span_low, self._ends[self._span_from]) <= start:
            self._span_low = max(self._span_low, self._ends[self._span_from])
            self._span_from += 1
        spans: list[Span] = []
        low = self._span_low
        for k in range(self._span_from, last + 1):
            high = len(self._text) if k == last else max(low, self._ends[k])
            a, b = max(low, start), min(high, end)
            if b > a:
                spans.append((self._text[a:b], self.origins[k]))
            low = max(low, high)
            if low >= end:
                break
        return spans
