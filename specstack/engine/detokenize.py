"""A growing token sequence's text, decoded incrementally (vLLM's `detokenize_incrementally`, with its
prefix and read offsets) and always equal to `tokenizer.decode(tokens, skip_special_tokens=False)`.

Each update decodes a small window, `tokens[prefix_offset:]`, and the window without the unread tokens,
`tokens[prefix_offset:read_offset]`; the text the unread tokens add is the difference. The window keeps
one step of left context so that a decoder whose output for a token depends on its place (a leading
space dropped at the start) agrees with the full decode. The difference becomes final, and the offsets
move on, only when it does not end in U+FFFD: a byte-level decoder writes an incomplete multi-byte
character as U+FFFD, and once the text ends in a whole character nothing after it can change what came
before. Until then the unread text is kept as it decodes now (U+FFFD included), as the full decode has it.

That holds for decoders whose text is the concatenation of their tokens' bytes: byte-level BPE
(GPT-2's, Llama 3's, Qwen's, SmolLM's), with no clean-up of tokenization spaces (which rewrites text
around punctuation, across the window's edge). Any other tokenizer gets the full decode each update: a
correct slow path rather than a fast one that may differ.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a byte-level decoder writes for bytes that are not (yet) a whole character


def decodes_incrementally(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s decode of a sequence is the decode of its parts joined, cut anywhere the
    text before ends in a whole character: a fast tokenizer whose decoder is byte-level, without the
    clean-up of tokenization spaces."""
    if tokenizer is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


class IncrementalDetokenizer:
    """The text of `tokens` as they grow (`update` after appending): `text`, its length, and `stable`, how
    many of its leading characters can no longer change."""

    def __init__(self, tokenizer: Any, incremental: bool | None = None) -> None:
        self.tokenizer = tokenizer
        fast = decodes_incrementally(tokenizer)
        self.incremental = fast if incremental is None else incremental
        # a tokenizer that passes the check decodes as its tokenizers-library backend does (transformers'
        # wrapper adds only the clean-up it lacks), and the wrapper's own cost is most of a short decode
        self._window_decode = tokenizer.backend_tokenizer.decode if fast else None
        self.prefix_offset = 0  # the window's first token: its left context
        self.read_offset = 0  # tokens before it are final text
        self._read_text = ""  # the text of tokens[:read_offset], final
        self._prefix_text = ""  # the window's text without the unread tokens: tokens[prefix_offset:read_offset]
        self._unread_text = ""  # the text of tokens[read_offset:] as it decodes now (it may still change)

    @property
    def text(self) -> str:
        return self._read_text + self._unread_text

    def __len__(self) -> int:
        return len(self._read_text) + len(self._unread_text)

    @property
    def stable(self) -> int:
        """How many leading characters of `text` no later token can change (0 on the full-decode path)."""
        return len(self._read_text)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _decode_window(self, ids: Sequence[int]) -> str:
        if self._window_decode is None:
            return self._decode(ids)
        return self._window_decode(list(ids), skip_special_tokens=False)

    def update(self, tokens: Sequence[int]) -> None:
        """Decode what `tokens` (all of them, the same list grown) added since the last update."""
        if not self.incremental:
            self._unread_text = self._decode(tokens)
            return
        window = self._decode_window(tokens[self.prefix_offset :])
        if not window.startswith(self._prefix_text):
            # the decoder rewrote its left context after all: full decodes from here on, which stay exact
            self.incremental = False
            self.prefix_offset = self.read_offset = 0
            self._read_text = self._prefix_text = ""
            self._unread_text = self._decode(tokens)
            return
        new = window[len(self._prefix_text) :]
        if new and not new.endswith(REPLACEMENT):
            self._read_text += new
            self._unread_text = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
            self._prefix_text = self._decode_window(tokens[self.prefix_offset : self.read_offset])
        else:
            # an incomplete character (or nothing yet): the window grows until it is whole
            self._unread_text = new
