"""The OpenAI request bodies, read into what the engine takes; errors in OpenAI's JSON shape.

A body is read by hand rather than by a pydantic model so that every number goes through the same
rules as the command line's flags (specstack/validate.py) and every error names its field in one
sentence. Fields that would change the output in a way this engine does not implement (logprobs,
penalties, logit_bias, tools, echo, best_of) are refused with 400 rather than silently
ignored: a client that asks for them would otherwise get text it did not ask for. `suffix` (OpenAI's
fill-in-the-middle field) is taken by a model with FIM tokens (fim.py) and refused by one without. Fields that do not
change the output (`user`, `metadata`, `store`, ...) are ignored, as OpenAI-compatible servers do.

Extensions in the body, as vLLM reads them: `top_k` (-1 or 0: off), `ignore_eos`, and `speculation`:
`{"method": "chain:k=2"}` picks a method for this request (any `--method` name; `ar` turns speculation
off), `{"enabled": false}` turns it off, `{"origins": true}` sends each streamed piece of text with the
origins of its tokens (target, draft, draft2, context: the server's page colours them). The output is the
same either way (lossless); only the speed differs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from specstack import validate
from specstack.config import GenerationConfig, SamplingParams
from specstack.errors import SpecstackError

Route = Literal["completions", "chat"]
MAX_CHOICES = 128  # n x prompts of one request: each is a row of the batch
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default max_tokens for /v1/completions
# refused unless they hold their "off" value: they would change the output
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


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
    messages: list[dict[str, str]] | None = None
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

    def generation(self, max_new_tokens: int, choice: int, stop_ids: tuple[int, ...] = ()) -> GenerationConfig:
        """Choice j (of a prompt's n) samples with seed + j, as `specstack generate --n` does: distinct,
        reproducible samples."""
        s = self.sampling
        if s.seed is not None:
            s = SamplingParams(s.temperature, s.top_k, s.top_p, (s.seed + choice) % (validate.SEED_MAX + 1))
        return GenerationConfig(max_new_tokens=max_new_tokens, sampling=s, stop_strings=self.stop,
                                stop_on_eos=not self.ignore_eos, stop_ids=stop_ids)


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


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with a role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {validate.shown(role)}", "messages")
        out.append({"role": ROLES[role], "content": _content(i, m)})
    return out


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
    return CompletionRequest(route, model, prompts, n, max_tokens, sampling, _stop(body.get("stop")),
                             _bool(body, "ignore_eos"), stream, include_usage, method, origins)


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
