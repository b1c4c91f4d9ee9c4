"""The OpenAI fields clients send, through the `openai` client against a real server process (the tiny
random checkpoint with the default model's tokenizer; the server speculates with its default method):
log-probabilities (completions, echo, chat, streamed), penalties and logit_bias taking effect, structured
output valid for its schema or regex, and tools: a forced call parsed into `tool_calls` (whole and as
streamed deltas) and a tool-calling round trip (call, tool result, answer), on a template that writes
tools and on the default model's, which writes none (the tools described in its system message)."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator

import jsonschema
import pytest
from server.servers import Server, start_server, stop_server

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "n", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
# a chat template that writes tools and tool calls as Qwen2.5's does (<tools> in the system turn,
# <tool_call>{json}</tool_call> in the assistant's, <tool_response> for results)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "For each call return <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny checkpoint whose tokenizer's chat template writes tools (the default model's does not)."""
    from tiny_checkpoints import Tiny

    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    root = tmp_path_factory.mktemp("tools")
    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    tok.chat_template = TOOLS_TEMPLATE
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's vocabulary holds them: one added token each
    Tiny("llama", 3, vocab=len(tok), hidden=64, layers=2, ff=128, max_pos=512, init=None, tie=True,
         bos=tok.bos_token_id, eos=tok.eos_token_id).save(root / "model", tok)
    server = start_server(root / "model", root, "--max-batch", "4", "--method", "chain:k=3", "--draft", "self:1")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny checkpoint with the default model's tokenizer (its template writes no tools) and room for
    several tools' descriptions and a call's round trip (1024 tokens)."""
    from tiny_checkpoints import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("roomy")
    server = start_server(build_tiny_checkpoint(root / "model", context=1024), root, "--max-batch", "2")
    yield server
    stop_server(server)


def test_completion_logprobs_and_echo(tiny_server: Server) -> None:
    client = tiny_server.client()
    out = client.completions.create(model=tiny_server.model, prompt="The sky is", max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy, no rules: the chosen is the best
    echo = client.completions.create(model=tiny_server.model, prompt="The sky is", max_tokens=8, temperature=0, logprobs=1, echo=True)
    e = echo.choices[0]
    assert e.text == "The sky is" + out.choices[0].text
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert e.logprobs.token_logprobs[-8:] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert "".join(e.logprobs.tokens) == e.text and e.logprobs.text_offset[0] == 0


def test_chat_logprobs_streamed_equal_whole(tiny_server: Server) -> None:
    client = tiny_server.client()
    args = dict(model=tiny_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0, logprobs=True,
                top_logprobs=2)
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == whole.message.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **args) if chunk.choices
                and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def test_penalties_and_logit_bias_take_effect(tiny_server: Server) -> None:
    client = tiny_server.client()
    base = dict(model=tiny_server.model, prompt="one two", max_tokens=12, temperature=0)
    plain = client.completions.create(**base, logprobs=0).choices[0]
    forced = client.completions.create(**base, logit_bias={"42": 100}, logprobs=0).choices[0]
    assert forced.logprobs.tokens == [forced.logprobs.tokens[0]] * 12 != plain.logprobs.tokens
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0, logprobs=0).choices[0]
    assert penalised.text != plain.text
    assert len(set(penalised.logprobs.tokens)) > len(set(plain.logprobs.tokens))  # repeats are what they cost


def test_json_schema_and_regex_outputs_are_valid(tiny_server: Server) -> None:
    client = tiny_server.client()
    for seed in range(4):
        out = client.chat.completions.create(
            model=tiny_server.model, messages=[{"role": "user", "content": "A colour as JSON"}], max_tokens=40, temperature=1.0,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.completions.create(model=tiny_server.model, prompt="Date:", max_tokens=20, temperature=0,
                                    extra_body={"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch("20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.choices[0].text)
    whole = client.chat.completions.create(model=tiny_server.model, messages=[{"role": "user", "content": "JSON"}], max_tokens=60,
                                           temperature=0, response_format={"type": "json_object"})
    text = whole.choices[0].message.content  # a random model's keys may run past max_tokens: then only a start
    assert text.startswith("{") and (whole.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_a_forced_tool_call_whole_and_streamed(tools_server: Server) -> None:
    client = tools_server.client()
    args = dict(model=tools_server.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                tool_choice="required", max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **args))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tool_calling_round_trip(tools_server: Server) -> None:
    """An agent's loop: the model calls the tool (forced by name), the tool's result goes back, the model
    answers (tool_choice auto: text, or another call, both well formed)."""
    client = tools_server.client()
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=tools_server.model, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    second = client.chat.completions.create(model=tools_server.model, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were in the prompt


# a call that fits a 256-token context with its description
LEVEL = {"type": "function", "function": {"name": "set_level", "parameters": {
    "type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"], "additionalProperties": False}}}
MODE = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


def test_tools_on_a_template_without_them_are_described_and_called(tiny_server: Server) -> None:
    """The default model's template writes no tools: they are described in the system message (vLLM's
    way) and a forced call is constrained as on any model, so an agent framework works with it."""
    client = tiny_server.client()
    level = LEVEL
    messages = [{"role": "user", "content": "Level 2?"}]
    plain = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=4, temperature=0)
    args = dict(model=tiny_server.model, messages=messages, tools=[level], max_tokens=32, temperature=0)
    forced = client.chat.completions.create(tool_choice="required", **args)
    assert forced.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' description is in the prompt
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_level"
    jsonschema.validate(json.loads(call.function.arguments), level["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, tool_choice="required", **args))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    auto = client.chat.completions.create(**{**args, "max_tokens": 8}).choices[0]  # tool_choice auto: text or a call
    assert auto.finish_reason in ("stop", "length", "tool_calls")


def test_a_named_call_and_its_result_on_a_template_without_tools(roomy_server: Server) -> None:
    """A function named by tool_choice on the default model's template: that function's call, valid for
    its schema, whole and streamed alike; then the call and its result go back in the conversation
    (written as text into its turns) and a required call follows."""
    client = roomy_server.client()
    named = {"type": "function", "function": {"name": "set_mode"}}
    args = dict(model=roomy_server.model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Mode?"}],
                tools=[WEATHER, LEVEL, MODE], max_tokens=40, temperature=0)
    first = client.chat.completions.create(tool_choice=named, **args)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_mode" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), MODE["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, tool_choice=named, **args))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.function.name] == ["set_mode"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    messages = [*args["messages"], choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    second = client.chat.completions.create(**{**args, "messages": messages}, tool_choice="required")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result are in the prompt
    assert second.choices[0].finish_reason == "tool_calls"
    (again,) = second.choices[0].message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in args["tools"]}
    jsonschema.validate(json.loads(again.function.arguments), tools[again.function.name])
