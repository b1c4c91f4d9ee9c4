"""The two routes' rows (serving_chat.py's CHAT, serving_completion.py's COMPLETIONS), without a server: what
each reads from a body, its defaults, and the exact bytes of its answers, whole and streamed, as OpenAI
shapes them. The shared code asks a route rather than branching on its name, so a wrong row shows here."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from specstack.processing import TokenLogprob
from specstack.server.logprobs import TokenText
from specstack.server.protocol import ApiError, Route, parse_request
from specstack.server.responses import Choice, Reply
from specstack.server.serving import new_tokens
from specstack.server.serving_chat import CHAT
from specstack.server.serving_completion import COMPLETIONS

MESSAGES = {"messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def route_id(value: object) -> str | None:
    """A parameter's test id: a route by its object name (pytest numbers the rest)."""
    return value.object if isinstance(value, Route) else None


def test_each_route_row_names_its_ids_objects_and_limits() -> None:
    assert (CHAT.id_prefix, CHAT.object, CHAT.chunk_object) == ("chatcmpl-", "chat.completion", "chat.completion.chunk")
    assert (COMPLETIONS.id_prefix, COMPLETIONS.object, COMPLETIONS.chunk_object) == \
        ("cmpl-", "text_completion", "text_completion")
    assert (CHAT.default_max_tokens, COMPLETIONS.default_max_tokens) == (None, 16)
    assert (CHAT.role_first, COMPLETIONS.role_first) == (True, False)
    for route in (CHAT, COMPLETIONS):
        reply = Reply(route, "m", 1)
        assert reply.id.startswith(route.id_prefix) and len(reply.id) == len(route.id_prefix) + 32


@pytest.mark.parametrize(("route", "body", "room", "expected"), [
    (COMPLETIONS, {"prompt": "hi"}, 90, 16),  # OpenAI's default for completions
    (COMPLETIONS, {"prompt": "hi"}, 5, 5),  # capped by the room left
    (CHAT, MESSAGES, 90, 90),  # chat: what the context leaves
    (CHAT, {**MESSAGES, "max_tokens": 9, "max_completion_tokens": 4}, 90, 4),  # the newer field wins
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 4}, 90, 16),  # not a completions field
], ids=route_id)
def test_new_tokens_default_and_limit_fields(route: Route, body: dict, room: int, expected: int) -> None:
    req = parse_request(route, body)
    assert new_tokens(SimpleNamespace(max_context=10 + room), req, 10) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("route", "body", "message", "param"), [
    (CHAT, {"prompt": "hi"}, "messages must be a non-empty list", "messages"),
    (COMPLETIONS, MESSAGES, "prompt is required", "prompt"),
    (CHAT, {**MESSAGES, "logprobs": 3}, "logprobs must be true or false, got 3", "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "echo": "yes"}, "echo must be true or false, got 'yes'", "echo"),
], ids=route_id)
def test_each_route_reads_its_own_fields(route: Route, body: dict, message: str, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(route, body)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, param)


def test_fields_of_the_other_route_are_not_read() -> None:
    """As OpenAI: chat has no `echo`, completions no `tools` (not even checked)."""
    chat = parse_request(CHAT, {**MESSAGES, "echo": "yes", "prompt": 5})
    assert not chat.echo and chat.prompts[0].messages == MESSAGES["messages"]
    completion = parse_request(COMPLETIONS, {"prompt": "hi", "tools": "f", "tool_choice": "required"})
    assert (completion.tools, completion.tool_choice) == (None, "none")
    assert parse_request(CHAT, {**MESSAGES, "tools": [TOOL]}).tool_names == {"f"}
    assert parse_request(COMPLETIONS, {"prompt": "hi", "logprobs": 2}).logprobs == 2
    assert parse_request(CHAT, {**MESSAGES, "logprobs": True, "top_logprobs": 2}).logprobs == 2


class Tokens:
    """A tokenizer whose token t reads "t<t>"."""

    def convert_ids_to_tokens(self, token: int) -> str:
        return f"t{token}"


def test_each_route_shapes_log_probabilities() -> None:
    text, lps = TokenText(Tokens()), [TokenLogprob(3, -0.5, ((3, -0.5), (4, -1.0)))]
    assert CHAT.logprobs_body(text, lps, 1, 0, None) == {"content": [{
        "token": "t3", "logprob": -0.5, "bytes": [116, 51],
        "top_logprobs": [{"token": "t3", "logprob": -0.5, "bytes": [116, 51]},
                         {"token": "t4", "logprob": -1.0, "bytes": [116, 52]}]}], "refusal": None}
    assert COMPLETIONS.logprobs_body(text, lps, 1, 4, None) == \
        {"tokens": ["t3"], "token_logprobs": [-0.5], "top_logprobs": [{"t3": -0.5, "t4": -1.0}], "text_offset": [4]}
    echoed = COMPLETIONS.logprobs_body(text, lps, 1, 0, ([1, 2], [TokenLogprob(2, -0.1, ((2, -0.1),))]))
    assert echoed["tokens"] == ["t1", "t2", "t3"] and echoed["token_logprobs"] == [None, -0.1, -0.5]


def frozen(route: Route) -> Reply:
    reply = Reply(route, "m", 7)
    reply.id, reply.created = route.id_prefix + "X", 1
    return reply


def chunk(reply: Reply, *args: Any, **kwargs: Any) -> str:
    data = reply.chunk(*args, **kwargs)
    assert data.startswith("data: ") and data.endswith("\n\n")
    return data[len("data: "):-2]


CALLS = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
USAGE = '"usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "prompt_tokens_details": ' \
        '{"cached_tokens": 2}}'


def test_chat_answers_bytes() -> None:
    reply = frozen(CHAT)
    head = '{"id": "chatcmpl-X", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": '
    assert chunk(reply, 0, None, first=True, usage_field=True) == head + \
        '[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}], ' \
        '"usage": null}'
    assert chunk(reply, 1, "hi", logprobs={"c": []}) == head + \
        '[{"index": 1, "delta": {"content": "hi"}, "logprobs": {"c": []}, "finish_reason": null}]}'
    assert chunk(reply, 0, None, "tool_calls", tool_calls=[{"index": 0}]) == head + \
        '[{"index": 0, "delta": {"tool_calls": [{"index": 0}]}, "logprobs": null, "finish_reason": "tool_calls"}]}'
    assert reply.usage_chunk(5, 2) == f"data: {head}[], {USAGE}}}\n\n"
    whole = json.dumps(reply.response([Choice("a", "stop"), Choice(None, "tool_calls", None, CALLS)], 5, 2))
    assert whole == '{"id": "chatcmpl-X", "object": "chat.completion", "created": 1, "model": "m", "choices": [' \
        '{"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": null, "finish_reason": "stop"}, ' \
        '{"index": 1, "message": {"role": "assistant", "content": null, "tool_calls": ' + json.dumps(CALLS) + \
        '}, "logprobs": null, "finish_reason": "tool_calls"}], ' + USAGE + '}'


def test_completion_answers_bytes() -> None:
    reply = frozen(COMPLETIONS)
    head = '{"id": "cmpl-X", "object": "text_completion", "created": 1, "model": "m", "choices": '
    assert chunk(reply, 0, None, "length", usage_field=True) == head + \
        '[{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}], "usage": null}'
    assert chunk(reply, 1, "hi", spans=(("hi", "draft"),)) == head + \
        '[{"index": 1, "text": "hi", "logprobs": null, "finish_reason": null, "origins": [["hi", "draft"]]}]}'
    assert reply.usage_chunk(5, 2) == f"data: {head}[], {USAGE}}}\n\n"
    whole = json.dumps(reply.response([Choice("a", "stop", {"x": 1})], 5, 2, {0: []}))
    assert whole == head.replace('"choices": ', '"choices": [') + \
        '{"index": 0, "text": "a", "logprobs": {"x": 1}, "finish_reason": "stop", "origins": []}], ' + USAGE + '}'
