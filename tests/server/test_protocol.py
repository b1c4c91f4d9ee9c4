"""Request bodies read by server/protocol.py, without a server: a bad field is a 400 in OpenAI's error
shape naming that field (and `unsupported_parameter` for what this engine does not implement); a good
body gives the request the engine runs (OpenAI's defaults, vLLM's extensions, per-choice seeds)."""
from __future__ import annotations

import json

import pytest

from specstack.server.protocol import MAX_CHOICES, ApiError, Route, parse_request
from specstack.server.serving_chat import CHAT
from specstack.server.serving_completion import COMPLETIONS

HI = {"prompt": "hi"}


def error(route: Route, body: object) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(route, body)
    err = e.value
    assert err.status == 400 and err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": err.param,
                                    "code": err.code}}
    return err


@pytest.mark.parametrize(("body", "param"), [
    ({**HI, "temperature": -1}, "temperature"),
    ({**HI, "temperature": "hot"}, "temperature"),
    ({**HI, "temperature": 1e-40}, "temperature"),  # overflows the scaled logits
    ({**HI, "top_p": 0}, "top_p"),
    ({**HI, "top_p": 1.5}, "top_p"),
    ({**HI, "top_k": -2}, "top_k"),
    ({**HI, "top_k": True}, "top_k"),
    ({**HI, "max_tokens": 0}, "max_tokens"),
    ({**HI, "max_tokens": 2.5}, "max_tokens"),
    ({**HI, "seed": -1}, "seed"),
    ({**HI, "seed": 2**64}, "seed"),
    ({**HI, "n": 0}, "n"),
    ({**HI, "n": MAX_CHOICES + 1}, "n"),
    ({"prompt": ["a", "b", "c"], "n": MAX_CHOICES // 2}, "n"),  # prompts x n choices over the limit
    ({**HI, "stop": [""]}, "stop"),
    ({**HI, "stop": [1]}, "stop"),
    ({**HI, "stop": ["x"] * 17}, "stop"),
    ({**HI, "stop": {"x": 1}}, "stop"),
    ({**HI, "stream": "yes"}, "stream"),
    ({**HI, "ignore_eos": 1}, "ignore_eos"),
    ({**HI, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({**HI, "stream": True, "stream_options": True}, "stream_options"),
    ({**HI, "model": 5}, "model"),
    ({**HI, "speculation": "fast"}, "speculation"),
    ({**HI, "speculation": {"method": "warp-drive"}}, "speculation"),
    ({**HI, "speculation": {"method": 5}}, "speculation"),
    ({**HI, "speculation": {"method": "chain", "k": 3}}, "speculation"),
    ({**HI, "speculation": {"enabled": "no"}}, "speculation"),
    ({**HI, "speculation": {"origins": 1}}, "speculation"),
    ({**HI, "suffix": 5}, "suffix"),
    ({"prompt": [1, 2], "suffix": "x"}, "suffix"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": ["ok", "\ud800"]}, "prompt"),  # a lone surrogate: not text
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_completion_field_is_400_naming_it(body: dict, param: str) -> None:
    assert error(COMPLETIONS, body).param == param


@pytest.mark.parametrize("messages", [
    None, [], "hello", [None], [{"content": "x"}], [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": 5}],
])
def test_bad_chat_messages_are_400_naming_messages(messages: object) -> None:
    assert error(CHAT, {"messages": messages}).param == "messages"


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("best_of", 2),
])
def test_what_would_change_the_output_is_refused_not_ignored(field: str, value: object) -> None:
    err = error(COMPLETIONS, {**HI, field: value})
    assert (err.param, err.code) == (field, "unsupported_parameter")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_openai_fields_reach_the_generation() -> None:
    r = parse_request(COMPLETIONS, {**HI, "logprobs": 3, "echo": True, "presence_penalty": 0.5, "frequency_penalty": -1,
                                      "repetition_penalty": 1.2, "logit_bias": {"17": 5, "3": -100},
                                      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    gen = r.generation(8, 0)
    assert (gen.logprobs, gen.prompt_logprobs, gen.logit_bias) == (3, True, ((17, 5.0), (3, -100.0)))
    assert (gen.penalties.presence, gen.penalties.frequency, gen.penalties.repetition) == (0.5, -1.0, 1.2)
    assert gen.grammar is not None and gen.grammar.kind == "json_schema" and json.loads(gen.grammar.text) == SCHEMA
    chat = parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4,
                                  "tools": [TOOL], "tool_choice": "required"})
    assert (chat.logprobs, chat.tool_choice, chat.tools[0]["function"]["name"]) == (4, "required", "get_weather")
    assert parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}).logprobs == 0
    assert parse_request(COMPLETIONS, {**HI, "regex": "[ab]+"}).grammar.kind == "regex"
    assert parse_request(COMPLETIONS, {**HI, "guided_grammar": 'start: "x"'}).grammar.kind == "lark"
    assert parse_request(COMPLETIONS, {**HI, "response_format": {"type": "json_object"}}).grammar.kind == "json_object"


def test_tool_calls_and_results_in_messages_reach_the_template() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    r = parse_request(CHAT, {"messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": None, "tool_calls": [call]},
                                            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    m = r.prompts[0].messages
    assert m[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert m[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(("route", "body", "param"), [
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETIONS, {"presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"frequency_penalty": "x"}, "frequency_penalty"),
    (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"1": 101}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": [1]}, "logit_bias"),
    (COMPLETIONS, {"response_format": {"type": "yaml"}}, "response_format"),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (COMPLETIONS, {"regex": "a", "response_format": {"type": "json_object"}}, "regex"),
    (COMPLETIONS, {"regex": " "}, "regex"),
    (CHAT, {"tools": [{"type": "function", "function": {}}]}, "tools"),
    (CHAT, {"tools": "f"}, "tools"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (CHAT, {"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    (CHAT, {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (COMPLETIONS, {"echo": True, "logprobs": 1, "stream": True}, "echo"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                               "arguments": "{"}}]}]},
     "messages"),
], ids=lambda v: v.object if isinstance(v, Route) else v if isinstance(v, str) else None)
def test_bad_values_of_openai_fields_are_400_naming_them(route: Route, body: dict, param: str) -> None:
    base = {COMPLETIONS: HI, CHAT: {"messages": [{"role": "user", "content": "x"}]}}[route]
    assert error(route, {**base, **body}).param == param


@pytest.mark.parametrize("body", [[1, 2], "hi", None, 5])
def test_a_body_that_is_not_an_object_is_400(body: object) -> None:
    assert error(COMPLETIONS, body).param is None


def test_defaults_are_openais_and_off_values_pass() -> None:
    """Unset fields take OpenAI's defaults; a refused field at its "off" value, and fields that change
    nothing (user, metadata), pass."""
    r = parse_request(COMPLETIONS, {**HI, "logprobs": None, "echo": False, "presence_penalty": 0, "logit_bias": {},
                                      "response_format": {"type": "text"}, "best_of": 1, "user": "u", "tools": [],
                                      "metadata": {"k": "v"}, "n": None, "temperature": None, "stop": None})
    assert (r.n, r.max_tokens, r.stop, r.stream, r.include_usage, r.ignore_eos, r.method) == \
        (1, None, (), False, False, False, None)
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (1.0, 0, 1.0, None)


def test_fields_reach_the_request() -> None:
    r = parse_request(COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                      "top_k": -1, "seed": 41, "stop": "END", "ignore_eos": True, "stream": True,
                                      "stream_options": {"include_usage": True}, "model": "m"})
    assert [p.text for p in r.prompts] == ["a", "b"]
    assert (r.n, r.max_tokens, r.stop, r.ignore_eos, r.stream, r.include_usage, r.model) == \
        (2, 7, ("END",), True, True, True, "m")
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) == (0.5, 0, 0.9)  # top_k -1: off
    gens = [r.generation(7, j) for j in range(2)]  # choice j samples with seed + j
    assert [g.sampling.seed for g in gens] == [41, 42]
    assert all(g.max_new_tokens == 7 and g.stop_strings == ("END",) and not g.stop_on_eos for g in gens)
    ids = parse_request(COMPLETIONS, {"prompt": [[1, 2], [3]]}).prompts
    assert [p.ids for p in ids] == [[1, 2], [3]]
    assert [p.ids for p in parse_request(COMPLETIONS, {"prompt": [5, 6]}).prompts] == [[5, 6]]


def test_speculation_picks_a_method_or_turns_it_off() -> None:
    assert parse_request(COMPLETIONS, {**HI, "speculation": {"enabled": False}}).method == "ar"
    assert parse_request(COMPLETIONS, {**HI, "speculation": {"enabled": True}}).method is None
    assert parse_request(COMPLETIONS, {**HI, "speculation": {"method": "ar"}}).method == "ar"
    method = parse_request(COMPLETIONS, {**HI, "speculation": {"method": "chain:k=3"}}).method
    assert method is not None and method.startswith("chain") and "k=3" in method


def test_chat_reads_messages_and_prefers_max_completion_tokens() -> None:
    r = parse_request(CHAT, {"messages": [{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None}],
                               "max_tokens": 9, "max_completion_tokens": 4})
    assert r.prompts[0].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": ""}]
    assert r.max_tokens == 4
    assert parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}).max_tokens == 9


def test_suffix_makes_fill_in_the_middle_prompts() -> None:
    req = parse_request(COMPLETIONS, {"prompt": ["a(", "b("], "suffix": ")\n"})
    assert [(p.text, p.suffix) for p in req.prompts] == [("a(", ")\n"), ("b(", ")\n")]
    assert parse_request(COMPLETIONS, {"prompt": "", "suffix": "x"}).prompts[0].text == ""  # the file's start
    assert parse_request(COMPLETIONS, {**HI, "speculation": {"origins": True}}).origins
