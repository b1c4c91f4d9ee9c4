"""`POST /v1/chat/completions`'s side of the shared route (serving.py): `messages` read into the chat
template's shape, `tools` and `tool_choice`, `logprobs: true` with `top_logprobs`, `max_completion_tokens`
before `max_tokens`; an answer as the assistant's `message` (with its `tool_calls`), streamed as deltas
that open with the assistant's role. vLLM's serving_chat.py holds the same beside serving_completion.py."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specstack import validate
from specstack.config import MAX_LOGPROBS
from specstack.processing import TokenLogprob
from specstack.server.logprobs import TokenText, chat_logprobs
from specstack.server.protocol import Prompt, Route, Tools, bad, bool_field, checked, string_field


def _content(i: int, message: dict[str, Any]) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return string_field(f"messages[{i}].content", content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(string_field(f"messages[{i}].content", part["text"]))
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
            message["tool_call_id"] = string_field(f"messages[{i}].tool_call_id", m["tool_call_id"])
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


def read_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
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


@dataclass(frozen=True)
class ChatRoute(Route):
    """The chat route's reading and shapes; its data (id prefix, object names, ...) is CHAT's row."""

    def read_prompts(self, body: dict[str, Any]) -> list[Prompt]:
        return [Prompt(messages=chat_messages(body.get("messages")))]

    def read_echo(self, body: dict[str, Any]) -> bool:
        return False  # OpenAI's chat has no `echo`: the field is not read, as there

    def read_tools(self, body: dict[str, Any]) -> Tools:
        return read_tools(body)

    def read_logprobs(self, body: dict[str, Any]) -> int | None:
        """`logprobs: true` and `top_logprobs: N` (0..20)."""
        on = bool_field(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not on:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None if not on else 0 if top is None else checked("top_logprobs", validate.ints(0, MAX_LOGPROBS), top)

    def logprobs_body(self, text: TokenText, lps: list[TokenLogprob], top: int, offset: int,
                      prompt: tuple[Sequence[int], Sequence[TokenLogprob]] | None) -> dict[str, Any]:
        return chat_logprobs(text, lps)  # each entry carries its own top_logprobs; no offsets, no echo

    def choice_body(self, text: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"message": message}

    def chunk_body(self, text: str | None, first: bool, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"delta": delta}


CHAT = ChatRoute(id_prefix="chatcmpl-", object="chat.completion", chunk_object="chat.completion.chunk",
                 limit_fields=("max_completion_tokens", "max_tokens"), default_max_tokens=None, role_first=True)
