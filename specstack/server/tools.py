"""Tool calls in chat: the grammar of a forced call, the model's calls parsed out of its text, and the
same as a stream of OpenAI deltas.

Qwen2.5's format (its chat template writes it into the system prompt): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. With `tool_choice: "auto"` the model
writes calls or text as it likes and the calls are parsed out; `"required"` or a named function makes
the output one such call, its arguments valid for the function's JSON schema (a Lark grammar embedding
the schema, so the engine masks and drafts it like any structured output).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from specstack.config import GrammarSpec
from specstack.grammar import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def forced_call_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> GrammarSpec | None:
    """The grammar of one call to a named function, or to any of `tools` ("required"); None otherwise."""
    if isinstance(choice, dict):
        fns = [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
    elif choice == "required":
        fns = [t["function"] for t in tools]
    else:
        return None
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in fns],
              "x-guidance": JSON_LAYOUT}
    return GrammarSpec("lark", f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None if there is none; the calls). A block that is not a call
    (not JSON, no name) stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at : m.start()])
        calls.append(call)
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else text, calls


class ToolStream:
    """A streamed answer's text split into content deltas and tool calls: text that may open a call is
    held until it is known not to; a call is sent once its block closes (its name, then its arguments,
    as OpenAI streams them)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self.buffer += text
        content, done = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if self.buffer.endswith(OPEN[:n])), 0)
                cut = len(self.buffer) - keep
                content += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                break
            content += self.buffer[:start]
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start : end + len(CLOSE)]
            call = _call(CALL.match(block).group(1)) if CALL.match(block) else None  # type: ignore[union-attr]
            if call is None:
                content += block
            else:
                done.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]
        if self.calls and content.strip() == "":
            content = ""  # the whitespace between calls is not content
        self.calls += done
        return content, done

    def finish(self) -> str:
        """What is left when the text ends (an unclosed block is text)."""
        rest, self.buffer = self.buffer, ""
        return rest
