"""The OpenAI request bodies, read into what the engine takes; errors in OpenAI's JSON shape; `Route`, what
sets chat apart from completions (serving_chat.py, serving_completion.py), so shared code asks it.

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
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specstack import validate
from specstack.config import MAX_BIAS, GenerationConfig, GrammarSpec, Penalties, SamplingParams
from specstack.errors import SpecstackError
from specstack.processing import TokenLogprob
from specstack.server.logprobs import TokenText

MAX_CHOICES = 128  # n x prompts of one request: each is a row of the batch
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
# refused unless they hold their "off" value: they would change the output
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
}
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


Tools = tuple[list[dict[str, Any]] | None, str | dict[str, Any]]  # `tools` (None: none) and `tool_choice`


@dataclass(frozen=True)
class Route(ABC):
    """What sets /v1/chat/completions apart from /v1/completions, one row of a table (serving_chat.py's CHAT,
    serving_completion.py's COMPLETIONS): the shared reading, checking and answering ask it rather than
    branch on a name, as vLLM keeps serving_chat.py beside serving_completion.py over shared parts.
    parse_request calls each `read_*` where it reads that field, so of several bad fields the same one is
    named first whichever route reads them."""

    id_prefix: str  # a response's id: this, then 32 hex digits
    object: str  # a whole response's "object"
    chunk_object: str  # a stream chunk's "object"
    limit_fields: tuple[str, ...]  # the fields that cap new tokens, the first one set wins
    default_max_tokens: int | None  # new tokens without a cap (None: what the context leaves)
    role_first: bool  # a stream opens with a delta naming the assistant's role, as OpenAI streams chat

    @abstractmethod
    def read_prompts(self, body: dict[str, Any]) -> list[Prompt]:
        """The request's prompts (a chat's one conversation, or a completion's prompts)."""

    @abstractmethod
    def read_echo(self, body: dict[str, Any]) -> bool:
        """Whether the prompt is part of the text and of its log-probabilities."""

    @abstractmethod
    def read_tools(self, body: dict[str, Any]) -> Tools:
        """The functions the model may call and `tool_choice`."""

    @abstractmethod
    def read_logprobs(self, body: dict[str, Any]) -> int | None:
        """Alternatives per token's log-probability (None: no log-probabilities)."""

    @abstractmethod
    def logprobs_body(self, text: TokenText, lps: list[TokenLogprob], top: int, offset: int,
                      prompt: tuple[Sequence[int], Sequence[TokenLogprob]] | None) -> dict[str, Any]:
        """A choice's log-probabilities in this route's shape: lps, its tokens'; offset: characters of
        its text sent before them; prompt: the prompt's ids and theirs, for `echo`."""

    @abstractmethod
    def choice_body(self, text: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        """A whole response's choice, less its index, logprobs and finish_reason (which frame it)."""

    @abstractmethod
    def chunk_body(self, text: str | None, first: bool, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        """A stream chunk's choice, less its index, logprobs and finish_reason (first: the stream's opening)."""


@dataclass(frozen=True)
class CompletionRequest:
    route: Route
    model: str | None
    prompts: list[Prompt]
    n: int
    max_tokens: int | None  # None: the route's default_max_tokens
    sampling: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    method: str | None  # a method for this request only; None: the server's
    origins: bool = False  # extension: each streamed piece of text with the origin of its tokens
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    echo: bool = False  # the prompt is part of the text (and of the logprobs): completions only
    penalties: Penalties = field(default_factory=Penalties)
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None  # response_format, regex or grammar
    grammar_param: str = "response_format"  # the field that gave it
    tools: list[dict[str, Any]] | None = None  # the functions the model may call: chat only
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


def string_field(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {type(value).__name__}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{name} is not valid text (a lone surrogate)", name) from None
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return tuple(checked("stop", validate.stop_string, s) for s in items)


def bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
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
    prompts = route.read_prompts(body)
    n = body.get("n")  # null: OpenAI's default, 1 (0 is an error, as there)
    n = 1 if n is None else checked("n", validate.ints(1, MAX_CHOICES, "choices decode as rows of the batch"), n)
    if n * len(prompts) > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n {n} = {n * len(prompts)} choices, over {MAX_CHOICES}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of is not supported by this server (other than equal to n)", "best_of", "unsupported_parameter")
    limit = next((body[name] for name in route.limit_fields if body.get(name) is not None), None)
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
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options is an object, allowed only with stream: true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    method, origins = speculation(body)
    echo = route.read_echo(body)
    if echo and stream and body.get("logprobs") not in (None, False):
        raise bad("echo with logprobs is answered whole, not streamed: drop stream or logprobs", "echo",
                  "unsupported_parameter")
    tools, tool_choice = route.read_tools(body)
    grammar_param, grammar = _grammar(body)
    if grammar is not None and tool_choice not in ("none", "auto"):
        raise bad("a forced tool call has its own grammar (its parameters): drop response_format", "tool_choice")
    return CompletionRequest(route, model, prompts, n, max_tokens, sampling, _stop(body.get("stop")),
                             bool_field(body, "ignore_eos"), stream, include_usage, method, origins,
                             logprobs=route.read_logprobs(body), echo=echo, penalties=_penalties(body),
                             logit_bias=_logit_bias(body.get("logit_bias")), grammar=grammar, grammar_param=grammar_param,
                             tools=tools, tool_choice=tool_choice)


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
            text = string_field(name, body[name])
            if not text.strip():
                raise bad(f"{name} is empty", name)
            found.append((name, GrammarSpec(kind, text)))  # type: ignore[arg-type]
    if len(found) > 1:
        raise bad(f"one output grammar at a time: {', '.join(n for n, _ in found)}", found[1][0])
    return found[0] if found else ("response_format", None)
