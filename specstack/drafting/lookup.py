"""Prompt-lookup decoding over the current sequence (prompt + output), part of draft2 (DESIGN §4): the
tokens that followed the most recent earlier occurrence of the last 3 (then 2, then 1) tokens. On code
this is usually the strongest signal (names, repeated lines, the signature in the docstring)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


# ---------------------------------------------------------------------------------------------------
# Prompt lookup over the current sequence
# ---------------------------------------------------------------------------------------------------
class ContextLookup:
    """Prompt-lookup decoding: where did the last n tokens (n = max_n .. 1) occur before, and what
    followed them? An index maps each n-gram to the positions of the tokens that followed its most
    recent occurrences (the last `keep`, most recent last).

    The index follows the sequence it is shown: `attach(tokens)` keeps the longest common prefix of
    what is indexed and `tokens`, rolls back the rest and indexes the new tokens, so a caller can
    pass the whole context every time (the engine's growing ctx.tokens, or the staged drafter's
    ctx.tokens + speculative spine) and pays only for what changed."""

    def __init__(self, max_n: int = 3, keep: int = 4) -> None:
        if max_n < 1 or keep < 1:
            raise ValueError("max_n and keep must be >= 1")
        self.max_n, self.keep = max_n, keep
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self, tokens: Iterable[int] = ()) -> None:
        self.tokens = []
        self._index = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, index, keep, max_n = self.tokens, self._index, self.keep, self.max_n
        for t in tokens:
            i = len(toks)  # the new token's position: it follows the n-grams ending at i - 1
            for n in range(1, min(max_n, i) + 1):
                key = tuple(toks[i - n:i])
                pos = index.get(key)
                if pos is None:
                    index[key] = [i]
                else:
                    pos.append(i)
                    if len(pos) > keep:
                        del pos[0]
            toks.append(int(t))

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (O(tokens removed)). Occurrences that the `keep`
        cap had already evicted do not come back: the index may hold fewer than `keep` afterwards."""
        toks, index = self.tokens, self._index
        for i in range(len(toks) - 1, max(length, 0) - 1, -1):
            for n in range(1, min(self.max_n, i) + 1):
                key = tuple(toks[i - n:i])
                pos = index.get(key)
                if pos and pos[-1] == i:
                    pos.pop()
                    if not pos:
                        del index[key]
        del toks[max(length, 0):]

    def attach(self, tokens: Sequence[int]) -> None:
        """Make the indexed sequence equal `tokens`, reusing the common prefix."""
        keep = _common_prefix(self.tokens, tokens)
        if keep < len(self.tokens):
            if keep < len(self.tokens) - len(tokens) // 2 - 64:
                self.reset(tokens)  # mostly a different sequence: rebuilding is cheaper
                return
            self.truncate(keep)
        if len(tokens) > keep:
            self.extend(tokens[keep:])

    sync = attach

    def matches(self, limit: int = 8) -> list[tuple[int, int]]:
        """(n, f) for earlier occurrences of the last n tokens, best first: longest n, then most
        recent; f is the position of the token that followed that occurrence."""
        toks, L = self.tokens, len(self.tokens)
        out: list[tuple[int, int]] = []
        for n in range(min(self.max_n, L - 1), 0, -1):
            for f in reversed(self._index.get(tuple(toks[L - n:]), ())):
                out.append((n, f))
                if len(out) >= limit:
                    return out
        return out

    def continuation(self, length: int) -> tuple[int, list[int]]:
        """(n, chain): up to `length` tokens that followed the best match, n its length (0: none)."""
        best = self.matches(limit=1)
        if not best:
            return 0, []
        n, f = best[0]
        return n, self.tokens[f:f + length]

    def next_tokens(self, limit: int = 4, min_n: int = 1) -> list[int]:
        """Distinct tokens that followed earlier occurrences of the suffix (matches of length >= min_n)."""
        out: list[int] = []
        for n, f in self.matches(limit=4 * limit):
            if n < min_n:
                break
            t = self.tokens[f]
            if t not in out:
                out.append(t)
                if len(out) >= limit:
                    break
        return out


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    """Length of the common prefix; fast when b extends a or differs only near the end."""
    n = min(len(a), len(b))
    b = b if isinstance(b, list) else list(b)
    if a[:n] == b[:n]:
        return n
    lo, hi, step = 0, n, 1  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while True:  # step back from the end (divergence is usually recent), then bisect
        j = max(0, n - step)
        if a[:j] == b[:j]:
            lo = j
            break
        hi, step = j, step * 4
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


