"""`POST /v1/completions`'s side of the shared route (serving.py): `prompt` (text, token ids, or lists of
either) with OpenAI's `suffix` (fill in the middle), `echo`, `logprobs: N`, 16 new tokens without
`max_tokens`; an answer as `text`, streamed as pieces of text. vLLM's serving_completion.py holds the same
beside serving_chat.py."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specstack import validate
from specstack.processing import TokenLogprob
from specstack.server.logprobs import TokenText, completion_logprobs, echoed
from specstack.server.protocol import Prompt, Route, Tools, bad, bool_field, checked, string_field

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default max_tokens for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`


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
            return [Prompt(text=string_field("prompt", p)) for p in value]
        if all(isinstance(p, list) for p in value):
            return [Prompt(ids=_token_ids("prompt", p)) for p in value]
        return [Prompt(ids=_token_ids("prompt", value))]
    if value is None:
        raise bad("prompt is required", "prompt")
    raise bad("prompt must be a string, a list of strings or a list of token ids", "prompt")


def with_suffix(body: dict[str, Any]) -> list[Prompt]:
    """A completion's prompts; with OpenAI's `suffix`, each is the code before the cursor and the model
    fills the middle (an empty prompt is then the start of a file)."""
    suffix = body.get("suffix")
    if suffix is None:
        return completion_prompts(body.get("prompt"))
    suffix = string_field("suffix", suffix)
    prompt = body.get("prompt")
    if prompt == "" or prompt == [""]:
        return [Prompt(text="", suffix=suffix)]
    prompts = completion_prompts(prompt)
    if any(p.text is None for p in prompts):
        raise bad("suffix goes with a text prompt (the code before the cursor), not token ids", "suffix")
    return [Prompt(text=p.text, suffix=suffix) for p in prompts]


@dataclass(frozen=True)
class CompletionRoute(Route):
    """The completions route's reading and shapes; its data (id prefix, object names, ...) is COMPLETIONS' row."""

    def read_prompts(self, body: dict[str, Any]) -> list[Prompt]:
        return with_suffix(body)

    def read_echo(self, body: dict[str, Any]) -> bool:
        return bool_field(body, "echo")

    def read_tools(self, body: dict[str, Any]) -> Tools:
        return None, "none"  # OpenAI's completions have no tools: the fields are not read, as there

    def read_logprobs(self, body: dict[str, Any]) -> int | None:
        """`logprobs: N` (0..5; null or false: none)."""
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        return checked("logprobs", validate.ints(0, MAX_COMPLETION_LOGPROBS, "OpenAI's limit"), value)

    def logprobs_body(self, text: TokenText, lps: list[TokenLogprob], top: int, offset: int,
                      prompt: tuple[Sequence[int], Sequence[TokenLogprob]] | None) -> dict[str, Any]:
        if prompt is not None:
            return echoed(text, prompt[0], prompt[1], lps, top)
        return completion_logprobs(text, lps, top, offset)

    def choice_body(self, text: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"text": text}

    def chunk_body(self, text: str | None, first: bool, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"text": text or ""}


COMPLETIONS = CompletionRoute(id_prefix="cmpl-", object="text_completion", chunk_object="text_completion",
                              limit_fields=("max_tokens",), default_max_tokens=DEFAULT_COMPLETION_TOKENS,
                              role_first=False)
