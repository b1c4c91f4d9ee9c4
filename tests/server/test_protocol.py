"""Request bodies read by server/protocol.py, without a server: a bad field is a 400 in OpenAI's error
shape naming that field (and `unsupported_parameter` for what this engine does not implement); a good
body gives the request the engine runs (OpenAI's defaults, vLLM's extensions, per-choice seeds)."""
from __future__ import annotations

import pytest

from specstack.server.protocol import MAX_CHOICES, ApiError, parse_request

HI = {"prompt": "hi"}


def error(route: str, body: object) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(route, body)  # type: ignore[arg-type]
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
    assert error("completions", body).param == param


@pytest.mark.parametrize("messages", [
    None, [], "hello", [None], [{"content": "x"}], [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": 5}],
])
def test_bad_chat_messages_are_400_naming_messages(messages: object) -> None:
    assert error("chat", {"messages": messages}).param == "messages"


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", 2), ("logprobs", True), ("top_logprobs", 1), ("echo", True),
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("repetition_penalty", 1.2), ("logit_bias", {"1": 5}),
    ("tools", [{"type": "function"}]), ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"}),
    ("best_of", 2),
])
def test_what_would_change_the_output_is_refused_not_ignored(field: str, value: object) -> None:
    err = error("completions", {**HI, field: value})
    assert (err.param, err.code) == (field, "unsupported_parameter")


@pytest.mark.parametrize("body", [[1, 2], "hi", None, 5])
def test_a_body_that_is_not_an_object_is_400(body: object) -> None:
    assert error("completions", body).param is None


def test_defaults_are_openais_and_off_values_pass() -> None:
    """Unset fields take OpenAI's defaults; a refused field at its "off" value, and fields that change
    nothing (user, metadata), pass."""
    r = parse_request("completions", {**HI, "logprobs": None, "echo": False, "presence_penalty": 0, "logit_bias": {},
                                      "response_format": {"type": "text"}, "best_of": 1, "user": "u",
                                      "metadata": {"k": "v"}, "n": None, "temperature": None, "stop": None})
    assert (r.n, r.max_tokens, r.stop, r.stream, r.include_usage, r.ignore_eos, r.method) == \
        (1, None, (), False, False, False, None)
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (1.0, 0, 1.0, None)


def test_fields_reach_the_request() -> None:
    r = parse_request("completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                      "top_k": -1, "seed": 41, "stop": "END", "ignore_eos": True, "stream": True,
                                      "stream_options": {"include_usage": True}, "model": "m"})
    assert [p.text for p in r.prompts] == ["a", "b"]
    assert (r.n, r.max_tokens, r.stop, r.ignore_eos, r.stream, r.include_usage, r.model) == \
        (2, 7, ("END",), True, True, True, "m")
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) == (0.5, 0, 0.9)  # top_k -1: off
    gens = [r.generation(7, j) for j in range(2)]  # choice j samples with seed + j
    assert [g.sampling.seed for g in gens] == [41, 42]
    assert all(g.max_new_tokens == 7 and g.stop_strings == ("END",) and not g.stop_on_eos for g in gens)
    ids = parse_request("completions", {"prompt": [[1, 2], [3]]}).prompts
    assert [p.ids for p in ids] == [[1, 2], [3]]
    assert [p.ids for p in parse_request("completions", {"prompt": [5, 6]}).prompts] == [[5, 6]]


def test_speculation_picks_a_method_or_turns_it_off() -> None:
    assert parse_request("completions", {**HI, "speculation": {"enabled": False}}).method == "ar"
    assert parse_request("completions", {**HI, "speculation": {"enabled": True}}).method is None
    assert parse_request("completions", {**HI, "speculation": {"method": "ar"}}).method == "ar"
    method = parse_request("completions", {**HI, "speculation": {"method": "chain:k=3"}}).method
    assert method is not None and method.startswith("chain") and "k=3" in method


def test_chat_reads_messages_and_prefers_max_completion_tokens() -> None:
    r = parse_request("chat", {"messages": [{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None}],
                               "max_tokens": 9, "max_completion_tokens": 4})
    assert r.prompts[0].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": ""}]
    assert r.max_tokens == 4
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}).max_tokens == 9


def test_suffix_makes_fill_in_the_middle_prompts() -> None:
    req = parse_request("completions", {"prompt": ["a(", "b("], "suffix": ")\n"})
    assert [(p.text, p.suffix) for p in req.prompts] == [("a(", ")\n"), ("b(", ")\n")]
    assert parse_request("completions", {"prompt": "", "suffix": "x"}).prompts[0].text == ""  # the file's start
    assert parse_request("completions", {**HI, "speculation": {"origins": True}}).origins
