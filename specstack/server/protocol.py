"""The OpenAI request bodies, read into what the engine takes; errors in OpenAI's JSON shape.

A body is read by hand rather than by a pydantic model so that every number goes through the same
rules as the command line's flags (specstack/validate.py) and every error names its field in one
sentence. Fields that would change the output in a way this engine does not implement (best_of, the
legacy `functions`, parallel tool calls forced by `tool_choice`) are refused with 400 rather than silently
ignored: a client that asks for them would otherwise get text it did not ask for. What a client reads from
the target (`logprobs`, `top_logprobs`, `echo`) and what changes the target's distribution (penalties,
`logit_bias`, `response_format`, `tools`) are applied inside verification, per tree node
(processing.py), so every method stays lossless under them. `suffix` (OpenAI's
fill-in-the-middle field) is taken by a model with FIM tokens (fim.py) and refused by one without. Fields that do not
change the output (`user`, `metadata`, `store`, ...) are ignored, as OpenAI-compatible servers do.

Extensions in the body, as vLLM reads them: `top_k` (-1 or 0: off), `ignore_eos`, `repetition_penalty`,
`regex` and `grammar` (a Lark grammar, llguidance's dialect; vLLM's `guided_regex`, `guided_grammar` and
`guided_json` name the same), and `speculation`:
`{"method": "chain:k=2"}` picks a method for this request (any `--method` name; `ar` turns speculation
off), `{"enabled": false}` turns it off, `{"origins": true}` sends each streamed piece of text with the
origins of its tokens (target, draft, draft2, context: the server's page colours them). The output is the
same either way (lossless); only the speed differs.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from specstack import validate
from specstack.config import MAX_BIAS, MAX_LOGPROBS, GenerationConfig, GrammarSpec, Penalties, SamplingParams
from specstack.errors import SpecstackError

Route = Literal["completions", "chat"]
MAX_CHOICES = 128  # n x prompts of one request: each is a row of the batch
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default max_tokens for /v1/completions
# refused unless they hold their "off" value: they would change the output
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries


@dataclass
class ApiError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its text (or the ids a client sent) and, for chat, its messages."""

    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    suffix: str | None = None  # fill in the middle: `text` is the code before the cursor, this the code after


@dataclass(frozen=True)
class CompletionRequest:
    route: Route
    model: str | None
    prompts: list[Prompt]
    n: int
    max_tokens: int | None  # None: the route's default (completions 16; chat: what the context leaves)
    sampling: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    method: str | None  # a method for this request only; None: the server's
    origins: bool = False  # extension: each streamed piece of text with the origin of its tokens
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    echo: bool = False  # completions: the prompt is part of the text (and of the logprobs)
    penalties: Penalties = field(default_factory=Penalties)
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None  # response_format, regex or grammar
    grammar_param: str = "response_format"  # the field that gave it
    tools: list[dict[str, Any]] | None = None  # chat: the functions the model may call
    tool_choice: str | dict[str, Any] = "auto"  # none, auto, required, or {"type": "function", ...}

    @property
    def tool_names(self) -> frozenset[str]:
        """The functions the model may call (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return frozenset()
        return frozenset(t["function"]["name"] for t in self.tools)

    def generation(self, max_new_tokens: int, choice: int, stop_ids: tuple[int, ...] = (),
                   grammar: GrammarSpec | None = None) -> GenerationConfig:
        """Choice j (of a prompt's n) samples with seed + j, as `specstack generate --n` does: distinct,
        reproducible samples. grammar: the request's own (a tool call's, built by the route) if not given."""
        s = self.sampling
        if s.seed is not None:
            s = SamplingParams(s.temperature, s.top_k, s.top_p, (s.seed + choice) % (validate.SEED_MAX + 1))
        return GenerationConfig(max_new_tokens=max_new_tokens, sampling=s, stop_strings=self.stop,
                                stop_on_eos=not self.ignore_eos, stop_ids=stop_ids, logprobs=self.logprobs,
                                prompt_logprobs=self.echo and self.logprobs is not None, penalties=self.penalties,
                                logit_bias=self.logit_bias, grammar=grammar or self.grammar)


def checked(name: str, rule: validate.Rule[Any], value: object) -> Any:
    """A validate rule's SpecstackError as a 400 that names the field."""
    try:
        return rule(name, value)
    except SpecstackError as e:
        raise bad(str(e), name) from None


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {type(value).__name__}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{name} is not valid text (a lone surrogate)", name) from None
    return value


def _token_ids(name: str, value: list[Any]) -> list[int]:
    if not value:
        raise bad(f"{name} is empty", name)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad(f"{name}: a list of token ids must hold non-negative integers", name)
    return list(value)


def completion_prompts(value: object) -> list[Prompt]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [Prompt(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [Prompt(text=_text("prompt", p)) for p in value]
        if all(isinstance(p, list) for p in value):
            return [Prompt(ids=_token_ids("prompt", p)) for p in value]
        return [Prompt(ids=_token_ids("prompt", value))]
    if value is None:
        raise bad("prompt is required", "prompt")
    raise bad("prompt must be a string, a list of strings or a list of token ids", "prompt")


def _content(i: int, message: dict[str, Any]) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(f"messages[{i}].content", content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(_text(f"messages[{i}].content", part["text"]))
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(value: object) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: role and text; an assistant's `tool_calls` with their
    arguments as objects (Hugging Face's convention: the template writes them as JSON), a tool result's
    `tool_call_id`."""
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with a role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {validate.shown(role)}", "messages")
        message: dict[str, Any] = {"role": ROLES[role], "content": _content(i, m)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_tool_call(i, c) for c in _list(f"messages[{i}].tool_calls", m["tool_calls"])]
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = _text(f"messages[{i}].tool_call_id", m["tool_call_id"])
        out.append(message)
    return out


def _list(name: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise bad(f"{name} must be a list", name.split(".")[0].split("[")[0])
    return value


def _tool_call(i: int, call: object) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where}: each call is {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise bad(f"{where}: arguments of {fn['name']!r} are not JSON", "messages") from None
    assert isinstance(call, dict)  # fn came from it
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return tuple(checked("stop", validate.stop_string, s) for s in items)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {validate.shown(value)}", name)
    return value


def speculation(body: dict[str, Any]) -> tuple[str | None, bool]:
    """The `speculation` extension: (the request's method or None for the server's, whether to send each
    piece of text with its tokens' origins)."""
    spec = body.get("speculation")
    if spec is None:
        return None, False
    if not isinstance(spec, dict) or set(spec) - {"method", "enabled", "origins"}:
        raise bad('speculation must be an object: {"method": NAME}, {"enabled": false}, {"origins": true}',
                  "speculation")
    for name in ("enabled", "origins"):
        if not isinstance(spec.get(name, True), bool):  # "no" or 0 would have left speculation on
            raise bad(f"speculation.{name} must be true or false, got {validate.shown(spec[name])}", "speculation")
    return _method(spec), bool(spec.get("origins", False))


def _method(spec: dict[str, Any]) -> str | None:
    if spec.get("enabled", True) is False:
        return "ar"
    method = spec.get("method")
    if method is None:
        return None
    if not isinstance(method, str):
        raise bad("speculation.method must be a method name, e.g. chain:k=2 or ar", "speculation")
    from specstack.engine.methods import parse_method  # light: the registry, no model

    try:
        return str(parse_method(method))
    except SpecstackError as e:
        raise bad(f"speculation.method: {e}", "speculation") from None


def parse_request(route: Route, body: object) -> CompletionRequest:
    """A request body -> a CompletionRequest, or ApiError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name, is_off in UNSUPPORTED.items():
        if name in body and not is_off(body[name]):
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if route == "chat":
        prompts = [Prompt(messages=chat_messages(body.get("messages")))]
    else:
        prompts = with_suffix(body)
    n = body.get("n")  # null: OpenAI's default, 1 (0 is an error, as there)
    n = 1 if n is None else checked("n", validate.ints(1, MAX_CHOICES, "choices decode as rows of the batch"), n)
    if n * len(prompts) > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n {n} = {n * len(prompts)} choices, over {MAX_CHOICES}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of is not supported by this server (other than equal to n)", "best_of", "unsupported_parameter")
    limit = body.get("max_completion_tokens") if route == "chat" else None
    limit = limit if limit is not None else body.get("max_tokens")
    max_tokens = None if limit is None else checked("max_tokens", validate.new_tokens, limit)
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else checked("top_k", validate.top_k, top_k)
    seed = body.get("seed")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    sampling = SamplingParams(  # OpenAI's defaults: temperature 1, top_p 1
        temperature=1.0 if temperature is None else checked("temperature", validate.temperature, temperature),
        top_k=top_k,
        top_p=1.0 if top_p is None else checked("top_p", validate.top_p, top_p),
        seed=None if seed is None else checked("seed", validate.seed, seed))
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options is an object, allowed only with stream: true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    method, origins = speculation(body)
    echo = route == "completions" and _bool(body, "echo")
    if echo and stream and body.get("logprobs") not in (None, False):
        raise bad("echo with logprobs is answered whole, not streamed: drop stream or logprobs", "echo",
                  "unsupported_parameter")
    tools, tool_choice = _tools(body) if route == "chat" else (None, "none")
    grammar_param, grammar = _grammar(body)
    if grammar is not None and tool_choice not in ("none", "auto"):
        raise bad("a forced tool call has its own grammar (its parameters): drop response_format", "tool_choice")
    return CompletionRequest(route, model, prompts, n, max_tokens, sampling, _stop(body.get("stop")),
                             _bool(body, "ignore_eos"), stream, include_usage, method, origins,
                             logprobs=_logprobs(route, body), echo=echo, penalties=_penalties(body),
                             logit_bias=_logit_bias(body.get("logit_bias")), grammar=grammar, grammar_param=grammar_param,
                             tools=tools, tool_choice=tool_choice)


def _logprobs(route: Route, body: dict[str, Any]) -> int | None:
    """Completions: `logprobs: N` (0..5, null: none); chat: `logprobs: true` and `top_logprobs: N` (0..20)."""
    if route == "completions":
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        return checked("logprobs", validate.ints(0, MAX_COMPLETION_LOGPROBS, "OpenAI's limit"), value)
    on = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not on:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return None if not on else 0 if top is None else checked("top_logprobs", validate.ints(0, MAX_LOGPROBS), top)


def _penalties(body: dict[str, Any]) -> Penalties:
    values = {name: body.get(name) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad(f"{name} must be a number, got {validate.shown(value)}", name)
    try:
        return Penalties(presence=values["presence_penalty"] or 0.0, frequency=values["frequency_penalty"] or 0.0,
                         repetition=1.0 if values["repetition_penalty"] is None else values["repetition_penalty"])
    except SpecstackError as e:
        raise bad(str(e), str(e).split(" ")[0].split(":")[0]) from None


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]} (the ids checked against the vocabulary
    where it is known, by the route)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIAS_ENTRIES:
        raise bad(f"logit_bias must be an object of at most {MAX_BIAS_ENTRIES} token ids to biases", "logit_bias")
    out = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None:
            raise bad(f"logit_bias: keys are token ids, got {validate.shown(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise bad(f"logit_bias: biases are numbers in [-100, 100], got {validate.shown(bias)}", "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


GRAMMAR_FIELDS = {"regex": "regex", "guided_regex": "regex", "grammar": "lark", "guided_grammar": "lark"}


def _grammar(body: dict[str, Any]) -> tuple[str, GrammarSpec | None]:
    """The output's grammar: `response_format` (json_object, json_schema), or an extension's regex or
    Lark grammar (vLLM's guided_* names too). One at most."""
    found: list[tuple[str, GrammarSpec]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad('response_format must be {"type": "text"}, {"type": "json_object"} or '
                      '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', "response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format.json_schema.schema must be a JSON schema (an object)", "response_format")
            found.append(("response_format", GrammarSpec("json_schema", json.dumps(schema))))
    if body.get("guided_json") is not None:
        schema = body["guided_json"]
        found.append(("guided_json", GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))))
    for name, kind in GRAMMAR_FIELDS.items():
        if body.get(name) is not None:
            text = _text(name, body[name])
            if not text.strip():
                raise bad(f"{name} is empty", name)
            found.append((name, GrammarSpec(kind, text)))  # type: ignore[arg-type]
    if len(found) > 1:
        raise bad(f"one output grammar at a time: {', '.join(n for n, _ in found)}", found[1][0])
    return found[0] if found else ("response_format", None)


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """`tools` (functions with JSON-schema parameters) and `tool_choice`."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None, "none"
    if not isinstance(tools, list):
        raise bad("tools must be a list of functions", "tools")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                      "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise bad(f"tool_choice names a function that is not in tools: {validate.shown(name)}", "tool_choice")
        return out, choice
    if choice not in ("none", "auto", "required"):
        raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                  "tool_choice")
    return out, choice


def with_suffix(body: dict[str, Any]) -> list[Prompt]:
    """A completion's prompts; with OpenAI's `suffix`, each is the code before the cursor and the model
    fills the middle (an empty prompt is then the start of a file)."""
    suffix = body.get("suffix")
    if suffix is None:
        return completion_prompts(body.get("prompt"))
    suffix = _text("suffix", suffix)
    prompt = body.get("prompt")
    if prompt == "" or prompt == [""]:
        return [Prompt(text="", suffix=suffix)]
    prompts = completion_prompts(prompt)
    if any(p.text is None for p in prompts):
        raise bad("suffix goes with a text prompt (the code before the cursor), not token ids", "suffix")
    return [Prompt(text=p.text, suffix=suffix) for p in prompts]
