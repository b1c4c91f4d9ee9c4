"""Tool calls in Qwen2.5's format (server/tools.py): parsed out of whole text, split out of a stream of
pieces however the text is cut (content released as soon as it cannot open a call), and a forced call's
grammar, which only such a call matches."""
from __future__ import annotations

import json

import pytest

from specstack.server.tools import ToolStream, forced_call_grammar, parse_calls

TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
       '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_calls_are_parsed_out_of_the_text():
    content, calls = parse_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>not json</tool_call>", "<tool_call>{\"x\": 1}</tool_call>",
                                  "<tool_call>\n{\"name\": \"f\"}"])
def test_what_is_not_a_call_stays_text(text):
    assert parse_calls(text) == (text, [])


def test_only_calls_is_no_content():
    assert parse_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')[0] is None


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, 1000])
def test_a_stream_cut_anywhere_gives_the_same_content_and_calls(cut):
    stream = ToolStream()
    content, names = "", []
    for i in range(0, len(TEXT), cut):
        piece, done = stream.feed(TEXT[i : i + cut])
        assert "<" not in piece  # nothing that may open a call is released
        content += piece
        names += [c.name for c in done]
    content += stream.finish()
    assert content.strip() == "Let me check." and names == ["get_weather", "get_time"]


def test_a_stream_holds_back_only_what_may_open_a_call():
    stream = ToolStream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    assert stream.feed("<tool_call>{\"name\"") == ("", [])
    assert stream.finish() == "<tool_call>{\"name\""  # never closed: text


def test_forced_call_grammar_names_the_functions():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    assert forced_call_grammar(tools, "auto") is None and forced_call_grammar(tools, "none") is None
    required = forced_call_grammar(tools, "required")
    named = forced_call_grammar(tools, {"type": "function", "function": {"name": "g"}})
    assert required.kind == named.kind == "lark"
    assert '"const": "f"' in required.text and '"const": "g"' in required.text
    assert '"const": "f"' not in named.text and required.text.startswith('start: "<tool_call>\\n"')
