"""`POST /infill`, as llama.cpp's server answers it: the body editors send (llama.vscode, llama.vim) read into
a FIM prompt and generation settings, and the response in llama.cpp's shape.

The request: `input_prefix` and `input_suffix` (required), `input_extra` ([{filename, text}], other files
of the project), `prompt` (the text typed on the cursor's line: it continues the prefix), `n_predict`
(-1: until the context is full), `t_max_predict_ms` and `n_indent` (editor stops, config.EditorStops),
`temperature` (default 0.8), `top_k` (40), `top_p` (0.95), `seed`, `stop`, `stream`, `samplers`,
`cache_prompt`, `return_tokens`, `response_fields`, and the `speculation` extension of the OpenAI routes.
Defaults are llama.cpp's; like llama.cpp, `temperature` applies only where `samplers` lists it (an editor
that sends `["top_k", "top_p", "infill"]` samples at temperature 1). Accepted without effect:
`cache_prompt` (the prefix cache is always exact, so reusing a prompt never changes the output), the
`infill` sampler (llama.cpp's merge of tokens that share a prefix; here the target's distribution is
sampled as it is), `t_max_prompt_ms`, `id_slot`. Fields that would change the output in a way this
server does not implement (`grammar`, penalties, `min_p`, `logit_bias`, `n_probs`, ...) are refused.

Errors are llama.cpp's shape: `{"error": {"code", "message", "type"}}`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specstack import validate
from specstack.config import EditorStops, GenerationConfig, SamplingParams
from specstack.engine.stats import GenerationResult
from specstack.errors import SpecstackError
from specstack.fim import ExtraFile
from specstack.server.protocol import ApiError, speculation

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
SAMPLERS = ("top_k", "top_p", "temperature", "infill", "min_p", "typ_p", "xtc", "dry", "penalties", "top_n_sigma")
# fields refused unless they hold llama.cpp's "off" value (they would change the output)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "grammar": lambda v: not v,
    "json_schema": lambda v: not v,
    "logit_bias": lambda v: not v,
    "n_probs": lambda v: v in (None, 0),
    "repeat_penalty": lambda v: v in (None, 1, 1.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "dry_multiplier": lambda v: v in (None, 0, 0.0),
    "mirostat": lambda v: v in (None, 0),
    "min_p": lambda v: v in (None, 0, 0.0),
    "typical_p": lambda v: v in (None, 1, 1.0),
    "xtc_probability": lambda v: v in (None, 0, 0.0),
    "n_probs_post_sampling": lambda v: not v,
}


@dataclass
class LlamaError(ApiError):
    """An error in llama.cpp's shape."""

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type}}


def bad(message: str) -> LlamaError:
    return LlamaError(400, message)


@dataclass(frozen=True)
class InfillRequest:
    prefix: str
    suffix: str
    extra: tuple[ExtraFile, ...]
    prompt: str
    n_predict: int | None  # None: until the context is full
    sampling: SamplingParams
    stop: tuple[str, ...]
    editor: EditorStops | None
    stream: bool
    return_tokens: bool
    response_fields: tuple[str, ...]
    method: str | None
    origins: bool = False

    def generation(self, max_new_tokens: int, stop_ids: tuple[int, ...]) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, sampling=self.sampling, stop_strings=self.stop,
                                editor=self.editor, stop_ids=stop_ids)


def _string(body: dict[str, Any], name: str, required: bool = False) -> str:
    if name not in body or body[name] is None:
        if required:
            raise bad(f'"{name}" is required')
        return ""
    value = body[name]
    if not isinstance(value, str):
        raise bad(f'"{name}" must be a string')
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f'"{name}" is not valid text (a lone surrogate)') from None
    return value


def _number(body: dict[str, Any], name: str, rule: validate.Rule[Any], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    try:
        return rule(name, value)
    except SpecstackError as e:
        raise bad(str(e)) from None


def _extra(value: object) -> tuple[ExtraFile, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad('"input_extra" must be an array of {"filename": string, "text": string}')
    out = []
    for chunk in value:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad('extra_context chunk must contain a "text" field with a string value')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise bad('extra_context chunk\'s "filename" field must be a string')
        out.append(ExtraFile(name, chunk["text"]))
    return tuple(out)


def _strings(body: dict[str, Any], name: str, limit: int) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(s, str) for s in value):
        raise bad(f'"{name}" must be an array of at most {limit} strings')
    return tuple(value)


def _samplers(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("samplers")
    if value is None:
        return SAMPLERS
    if isinstance(value, str):  # llama.cpp also takes a string of one-letter codes; the names are what editors send
        raise bad('"samplers" must be an array of sampler names, e.g. ["top_k", "top_p", "temperature"]')
    names = _strings(body, "samplers", 32)
    unknown = [s for s in names if s not in SAMPLERS]
    if unknown:
        raise bad(f'"samplers": unknown sampler {unknown[0]!r} (known: {", ".join(SAMPLERS)})')
    return names


def parse_infill(body: object) -> InfillRequest:
    """A /infill body -> an InfillRequest, or a llama.cpp-shaped 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name, is_off in UNSUPPORTED.items():
        if name in body and not is_off(body[name]):
            raise bad(f'"{name}" is not supported by this server')
    samplers = _samplers(body)
    temperature = _number(body, "temperature", validate.temperature, LLAMA_DEFAULTS["temperature"])
    top_k = _number(body, "top_k", validate.ints(-1, validate.MAX_COUNT), LLAMA_DEFAULTS["top_k"])
    top_p = _number(body, "top_p", validate.top_p, LLAMA_DEFAULTS["top_p"])
    seed = body.get("seed")  # llama.cpp's -1 (or 0xFFFFFFFF): a random seed
    seed = None if seed in (None, -1, 0xFFFFFFFF) else _number(body, "seed", validate.seed, None)
    sampling = SamplingParams(temperature=temperature if "temperature" in samplers else 1.0,
                              top_k=top_k if "top_k" in samplers and top_k > 0 else 0,
                              top_p=top_p if "top_p" in samplers else 1.0, seed=seed)
    n_predict = _number(body, "n_predict", validate.ints(-1, validate.MAX_CONTEXT), -1)
    if n_predict == 0:
        raise bad('"n_predict" must be -1 (until the context is full) or at least 1')
    t_max = _number(body, "t_max_predict_ms", validate.ints(0, 10**9), 0)
    n_indent = _number(body, "n_indent", validate.ints(0, 10**6), 0)
    editor = EditorStops(t_max / 1000 if t_max > 0 else None, n_indent) if t_max > 0 or n_indent > 0 else None
    stop = _strings(body, "stop", 16)
    for s in stop:
        if not s:
            raise bad('"stop" strings must not be empty')
    for name in ("stream", "cache_prompt", "return_tokens"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad(f'"{name}" must be true or false')
    try:
        method, origins = speculation(body)
    except ApiError as e:
        raise bad(e.message) from None
    return InfillRequest(
        prefix=_string(body, "input_prefix", required=True), suffix=_string(body, "input_suffix", required=True),
        extra=_extra(body.get("input_extra")), prompt=_string(body, "prompt"),
        n_predict=None if n_predict == -1 else n_predict, sampling=sampling, stop=stop,
        editor=editor, stream=bool(body.get("stream", False)), return_tokens=bool(body.get("return_tokens", False)),
        response_fields=_strings(body, "response_fields", 64), method=method, origins=origins)


STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit"}


def timings(result: GenerationResult) -> dict[str, float]:
    """llama.cpp's `timings`: the prompt's tokens read (not those taken from the prefix cache) and the
    generated ones, each with its time."""
    s = result.stats
    read = max(0, s.prompt_tokens - s.cached_tokens)
    prompt_ms, predicted_ms = s.prefill_seconds * 1e3, s.decode_seconds * 1e3
    n = len(result.tokens)
    return {"cache_n": s.cached_tokens, "prompt_n": read, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / read if read else 0.0,
            "prompt_per_second": read / s.prefill_seconds if s.prefill_seconds > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n / s.decode_seconds if s.decode_seconds > 0 else 0.0}


def final_body(req: InfillRequest, result: GenerationResult, model: str, truncated: bool, method: str,
               spans: list[tuple[str, str]] | None) -> dict[str, Any]:
    """The last (or only) answer: llama.cpp's fields, plus `speculation` (what ran and how it did)."""
    s = result.stats
    origins = Counter(result.origins)  # of the tokens emitted (an EOS a step also verified is not one)
    body: dict[str, Any] = {
        "index": 0, "content": result.text, "tokens": result.tokens if req.return_tokens else [], "id_slot": 0,
        "stop": True, "model": model, "tokens_predicted": len(result.tokens), "tokens_evaluated": s.prompt_tokens,
        "has_new_line": "\n" in result.text, "truncated": truncated,
        "stop_type": STOP_TYPES[result.finish_reason], "stopping_word": result.stop_word or "",
        "tokens_cached": s.prompt_tokens + len(result.tokens), "timings": timings(result),
        "speculation": {"method": method, "tau": round(s.tau, 4), "target_forwards": s.target_forwards,
                        "origins": dict(origins)}}
    if spans is not None:
        body["origins"] = [list(p) for p in spans]
    return nested(req.response_fields, body) if req.response_fields else body


def nested(paths: tuple[str, ...], body: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: only the fields named, each path ("timings/prompt_n") a key."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def partial_body(text: str, tokens: int, prompt_tokens: int, spans: tuple[tuple[str, str], ...] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": 0,
                            "tokens_predicted": tokens, "tokens_evaluated": prompt_tokens}
    if spans is not None:
        body["origins"] = [list(p) for p in spans]
    return body
