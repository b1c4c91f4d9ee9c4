"""The token stream's stops and spans (engine/stopping.py): an editor's indentation and time stops as
llama.cpp's /infill applies them, the stop string that ended the text, and released text cut at its
tokens with their origins (the page colours them) joining to exactly the text shown."""
from __future__ import annotations

import time

import pytest

from specstack.config import EditorStops
from specstack.engine.stopping import TokenStream
from specstack.errors import SpecstackError


@pytest.fixture(scope="module")
def tok():
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    return load_tokenizer(resolve(DEFAULT_MODEL), None)


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def test_indent_stop_cuts_before_a_line_indented_less():
    stops = EditorStops(indent=4)
    assert stops.cut("x = 1\n    y = 2\n", 0.0, "") is None  # deep enough; a line still empty is not judged
    blank = "x = 1\n    y = 2\n\n    z = 3"  # a blank line ends it, as in llama.cpp: its break is cut
    assert stops.cut(blank, 0.0, "") == len("x = 1\n    y = 2\n")
    text = "x = 1\n    y = 2\nprint(y)"
    assert stops.cut(text, 0.0, "") == text.index("print")  # the line's code goes, its indentation (none) stays
    assert stops.cut("a\n  b", 0.0, "") == len("a\n  ")
    assert EditorStops().cut("a\nb", 0.0, "") is None  # indent 0: off


def test_time_stop_waits_for_a_line_break_after_the_limit():
    stops = EditorStops(seconds=0.5)
    assert stops.cut("a = 1\nb", 0.1, "\nb") is None  # a break before the limit: goes on
    assert stops.cut("a = 1\nb = 2", 0.9, " 2") is None  # past it, but no break in the new text
    assert stops.cut("a = 1\nb = 2\n", 0.9, " 2\n") == len("a = 1\nb = 2\n")
    with pytest.raises(SpecstackError):
        EditorStops(seconds=-1.0)


def test_stream_applies_the_editor_stops(tok):
    body = ids(tok, "def f():\n    return 1\nprint(f())\n")
    stream = TokenStream(tok, 100, editor=EditorStops(indent=4))
    for t in body:
        stream.push([t])
        if stream.done:
            break
    assert stream.finish_reason == "length"
    assert stream.text == "def f():\n    return 1\n"
    slow = TokenStream(tok, 100, editor=EditorStops(seconds=0.05))
    slow.push(ids(tok, "a = 1"))
    time.sleep(0.1)
    slow.push(ids(tok, " + 2"))
    assert not slow.done
    slow.push(ids(tok, "\nb"))
    assert slow.done and slow.text.startswith("a = 1 + 2\n")


def test_stop_word_is_recorded(tok):
    stream = TokenStream(tok, 100, stop_strings=("\n\n", "return"))
    stream.push(ids(tok, "x = 1\n    return x"))
    assert stream.finish_reason == "stop" and stream.stop_word == "return" and stream.text == "x = 1\n    "


def test_spans_join_to_the_released_text_with_each_tokens_origin(tok):
    seen: list[tuple[str, str]] = []
    shown: list[str] = []
    stream = TokenStream(tok, 100, stop_strings=("STOP",), on_text=shown.append, on_spans=seen.extend)
    words = ids(tok, "héllo wörld, ünïcode ✓ ST") + ids(tok, "OP and more")
    origins = ["target", "draft", "draft", "context"]
    for i in range(0, len(words), 4):
        chunk = words[i : i + 4]
        stream.push(chunk, origins[: len(chunk)])
    assert "".join(text for text, _ in seen) == "".join(shown) == stream.text == "héllo wörld, ünïcode ✓ "
    assert {o for _, o in seen} <= set(origins)
    assert stream.origins[: len(words)] == [origins[j % 4] for j in range(len(stream.origins))]
    # token by token, the first spans are the tokens' own texts with their origins
    first = tok.decode(words[:1])
    assert seen[0] == (first, "target")
