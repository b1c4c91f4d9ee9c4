"""Tool calls in chat: the grammar of a forced call, the model's calls parsed out of its text, and the
same as a stream of OpenAI deltas.

Qwen2.5's format (its chat template writes it into the system prompt): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. With `tool_choice: "auto"` the model
writes calls or text as it likes and the calls are parsed out; `"required"` or a named function makes
the output one such call, its arguments valid for the function's JSON schema (a Lark grammar embedding
the schema, so the engine masks and drafts it like any structured output).

A model whose chat template writes no tools (the default SmolLM2) gets them the way vLLM gives them:
described in the system message, in the same format (asked for a call when the call is forced), with
its earlier calls written into its turns as it would write them and the tools' results as user turns
in `<tool_response>` tags, as Qwen2.5's template writes them (`tools_described`; a template that
knows only system, user and assistant renders them). A forced call is constrained by the same grammar,
whose tags are text for such a tokenizer, so the parsing below reads it back: an agent framework works
with any model. With `"auto"` the model is asked the same way and may answer in text or with a call.

Qwen2.5-Coder, asked with `tool_choice: "auto"`, usually writes its call without the tags, as a JSON
object in a ```json fence (a known habit of the coder models; Ollama parses it the same way). An answer
that is nothing but such an object (or a list of them) naming one of the request's tools is read as its
calls; anywhere else JSON stays text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from specstack.config import GrammarSpec
from specstack.grammar import JSON_LAYOUT
from specstack.prompts import encode_chat, template_writes_tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

The functions you may call, one JSON signature a line, within <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, answer with a JSON object of its name and arguments within <tool_call></tool_call>:
<tool_call>
{{"name": <function name>, "arguments": <its arguments as a JSON object>}}
</tool_call>
Each call's result comes back within <tool_response></tool_response>."""
# a forced call (tool_choice "required" or a function's name): the grammar forces the shape; asking for
# it in words keeps what the model writes inside the arguments closer to what it means
FORCED = {"required": "Answer now with one call to one of these functions.",
          "function": "Answer now with a call to {name}."}
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def tools_described(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    choice: str | dict[str, Any] = "auto") -> list[dict[str, Any]]:
    """The conversation for a chat template that writes no tools: the tools (if any) described at the end
    of the system message (one is added where there is none: many templates take one system message,
    first), each assistant turn's calls written into its text as OPEN {"name", "arguments"} CLOSE, as the
    model is asked to write them, and each run of tool results as one user turn of <tool_response>
    blocks. A conversation with neither tools nor calls nor results is returned as it is."""
    out: list[dict[str, Any]] = []
    results = False  # the last turn of `out` holds tool results
    for m in messages:
        if m["role"] == "tool":
            response = f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"
            if results:  # the results of one turn's calls: one user turn, as roles alternate
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
            results = True
            continue
        results = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                              f"\n{CLOSE}" for c in m["tool_calls"])
            m = {"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if not tools:
        return out
    described = TOOLS_PROMPT.format(signatures="\n".join(json.dumps(t) for t in tools))
    if isinstance(choice, dict):
        described += "\n" + FORCED["function"].format(name=choice["function"]["name"])
    elif choice in FORCED:
        described += "\n" + FORCED[choice]
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def encode_with_tools(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      choice: str | dict[str, Any] = "auto") -> list[int]:
    """A chat's prompt ids: the tools written by the model's own template where it writes them (its
    conversation as it is), else described (tools_described), the calls and results as text."""
    if template_writes_tools(tokenizer):
        return encode_chat(tokenizer, messages, tools=tools)
    return encode_chat(tokenizer, tools_described(messages, tools, choice))


def tag_terminals(tokenizer: Any) -> tuple[str, str]:
    """OPEN and CLOSE as a grammar names them for this tokenizer. Where the vocabulary holds a tag as one
    added token (Qwen2.5's `<tool_call>` is 151657), the grammar names that token (`<[id]>`): the
    tokenizer writes the tag's text as it, and llguidance matches an added token by its id, never by its
    text (a text literal would allow the token in the mask and refuse it when it is emitted)."""
    added = getattr(tokenizer, "added_tokens_encoder", {})
    return tuple(f"<[{added[tag]}]>" if tag in added and tokenizer.encode(tag, add_special_tokens=False) == [added[tag]]
                 else json.dumps(tag) for tag in (OPEN, CLOSE))  # type: ignore[return-value]


def forced_call_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                        tags: tuple[str, str] = (json.dumps(OPEN), json.dumps(CLOSE))) -> GrammarSpec | None:
    """The grammar of one call to a named function, or to any of `tools` ("required"); None otherwise.
    `tags`: the grammar's terminals for OPEN and CLOSE (`tag_terminals` of the model's tokenizer)."""
    if isinstance(choice, dict):
        fns = [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
    elif choice == "required":
        fns = [t["function"] for t in tools]
    else:
        return None
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in fns],
              "x-guidance": JSON_LAYOUT}
    return GrammarSpec("lark", f'start: {tags[0]} "\\n" call "\\n" {tags[1]}\ncall: %json {json.dumps(schema)}')


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


FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.S)


def lone_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of an answer that is only a call object, or a list of them, bare or in one ```json fence,
    each naming one of `names`; [] for anything else."""
    body = text.strip()
    fenced = FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body.startswith(("{", "[")):
        return []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(json.dumps(o)) if isinstance(o, dict) and o.get("name") in names else None for o in objs]
    return [c for c in calls if c is not None] if objs and None not in calls else []


def could_be_lone(text: str) -> bool:
    """Whether an answer that begins with `text` may still turn out to be a lone call (lone_calls)."""
    s = text.lstrip()
    if s.startswith("```"):
        head, newline, rest = s[3:].partition("\n")
        if not newline:
            return "json".startswith(head.strip())
        if head.strip() not in ("", "json"):
            return False
        rest = rest.lstrip()
        if not rest:
            return True
        if rest[0] not in "{[":
            return False
        end = rest.find("```")
        return end < 0 or rest[end + 3:].strip() == ""
    return "```".startswith(s) or s[0] in "{["


def parse_calls(text: str, names: frozenset[str] = frozenset()) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None if there is none; the calls). A block that is not a call
    (not JSON, no name) stays in the text; an answer with no tagged call may be a lone one (lone_calls)."""
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
    if not calls:
        lone = lone_calls(text, names)
        return (None, lone) if lone else (text, [])
    content = "".join(kept).strip()
    return content or None, calls


class ToolStream:
    """A streamed answer's text split into content deltas and tool calls: text that may open a call is
    held until it is known not to; a call is sent once its block closes (its name, then its arguments,
    as OpenAI streams them)."""

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self.names = names
        self.lone = bool(names)  # the answer so far may be a lone call: all of it is held

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self.buffer += text
        if self.lone:
            if could_be_lone(self.buffer) and OPEN not in self.buffer:
                return "", []
            self.lone = False
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

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the text ends: (content, calls). An unclosed block is text; an answer held
        whole is its calls if it is a lone call, else text."""
        rest, self.buffer = self.buffer, ""
        if self.lone and (lone := lone_calls(rest, self.names)):
            self.calls += lone
            return "", lone
        return rest, []

    def deltas(self, done: list[ToolCall]) -> list[dict[str, Any]]:
        """OpenAI's tool-call deltas for calls just completed (the last of self.calls): the name first,
        then the arguments."""
        n = len(self.calls) - len(done)
        return [d for k, c in enumerate(done) for d in (
            {"index": n + k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}},
            {"index": n + k, "function": {"arguments": c.arguments}})]
