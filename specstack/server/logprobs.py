"""The target's log-probabilities in OpenAI's shapes: /v1/completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat (`content`: token, logprob, bytes, top_logprobs). They are the
raw logits' (before penalties, bias, a grammar and the sampling warp), as OpenAI reports them, read from
the forward that verified each token (processing.py)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specstack.processing import TokenLogprob


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte in a byte-level
    BPE vocabulary (Qwen's, SmolLM2's) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTES = _byte_decoder()


class TokenText:
    """A tokenizer's tokens as text and bytes (cached: a response names the same tokens often)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and all(c in BYTES for c in piece):
                raw = bytes(BYTES[c] for c in piece)
            else:  # a special token, or a vocabulary that is not byte-level
                raw = self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")
            self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token]


def chat_logprobs(text: TokenText, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        s, b = text(token)
        return {"token": s, "logprob": logprob, "bytes": b}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


def completion_logprobs(text: TokenText, lps: Sequence[TokenLogprob | None], top: int, offset: int = 0) -> dict[str, Any]:
    """lps: one per token of the returned text (None for the prompt's first, which nothing scored);
    offset: where the text starts (text_offset counts characters from the start of the returned text)."""
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for lp in lps:
        if lp is None:  # only the prompt's first token: its text is in the returned text, unscored
            continue
        s, _ = text(lp.token)
        tokens.append(s)
        values.append(lp.logprob)
        tops.append({text(t)[0]: v for t, v in lp.top} if top else None)
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echoed(text: TokenText, prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprob],
           lps: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """The prompt's tokens (the first with null, as OpenAI answers) then the completion's."""
    first, _ = text(prompt_ids[0])
    rest = completion_logprobs(text, [*prompt_lps, *lps], top, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}
