"""What the prefix-cache workloads of `specstack bench-serve` send (issue 33), as pure functions of their
settings and texts: no network, no clock. serve_sessions.py sends them; serve_sources.py reads the texts.

- `chat`: multi-turn conversations. Turn t sends the whole history: the optional system message, the
  user turns 1..t and the server's own answers to turns 1..t-1 (`chat_messages`). A server with a
  prefix cache reuses the previous turn's prompt; one without reads the whole history again.
- `editor`: an editor's completions in one long file, the cursor moving forward `step_chars` per request.
  The prompt is the text before the cursor, about `window_chars` of it (`editor_windows`). A window that
  slid with the cursor char by char would change its first token on every request and share no prefix
  with the last one, so its start moves in jumps of `anchor_chars` (to a line start), as editor plugins
  that keep a server's cache warm do; `anchor_chars` 0 slides it exactly, the case no prefix cache helps.
- `prefix-probe`: the issue's two point goals (`probe_prompts`): (a) a long prompt sent cold, then the
  same prompt plus a short tail (an exact extension: only the tail is new); (b) `n` samples of a prompt
  against one sample of the same text on a fresh prefix, both cold. Every probe prompt starts with a line
  of its own (a hash of the run's nonce), so it is cold even on a server that read the file before; two
  probe prompts share at most the `# ` of that line.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from specstack.bench.serve_settings import RequestRow
from specstack.bench.serve_sources import EDITOR_MODULE
from specstack.errors import SpecstackError

Message = dict[str, str]


@dataclass(frozen=True)
class ChatSettings:
    conversations: int = 10
    turns: int = 5
    concurrency: int = 4  # conversations in flight, each sending its next turn when its last answer ends
    turn_chars: int = 1000  # a conversation with a longer user turn among its first `turns` is skipped
    system: str | None = None


@dataclass(frozen=True)
class EditorSettings:
    source: str = EDITOR_MODULE  # a standard-library module
    requests: int = 40
    window_chars: int = 6000  # with the anchor, 6,000-7,100 characters: ~1,500-1,850 tokens of Python
    step_chars: int = 48  # the cursor's move between requests
    anchor_chars: int = 1024  # the window's start moves in jumps of this (0: with the cursor)


@dataclass(frozen=True)
class ProbeSettings:
    repeats: int = 3  # each on files of its own
    probe_chars: int = 7400  # (a)'s prompt, ~1,900 tokens
    tail_chars: int = 200  # (a)'s new tail, ~50 tokens
    n: int = 8  # (b)'s samples
    n_chars: int = 3900  # (b)'s prompt, ~1,000 tokens


@dataclass
class WorkloadRow:
    """One request of a workload: `group` is the conversation (chat), 0 (editor) or the repeat (probe);
    `step` the turn from 1 (chat), the request from 0 (editor) or the place within its repeat (probe);
    `kind` turn, edit, or the probe's cold | extended | n1 | nN; `source` the conversation or module."""
    workload: str
    group: int
    step: int
    kind: str
    source: str
    prompt_chars: int
    request: RequestRow

    def as_dict(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "request"}
        return {**head, **asdict(self.request)}


# ---------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------
def chat_messages(user_turns: Sequence[str], answers: Sequence[str], system: str | None = None) -> list[Message]:
    """The messages of turn len(answers) + 1: the system message if any, then each earlier user turn
    followed by the server's answer to it, then this turn's user message."""
    turn = len(answers) + 1
    if turn > len(user_turns):
        raise ValueError(f"turn {turn} of a conversation of {len(user_turns)} user turns")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    for user, answer in zip(user_turns, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": user_turns[turn - 1]})
    return messages


def message_chars(messages: Sequence[Message]) -> int:
    return sum(len(m["content"]) for m in messages)


# ---------------------------------------------------------------------------------------------------
# editor
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EditorWindow:
    """One completion request: the file's text from `start` to the cursor."""
    start: int
    cursor: int
    text: str


def editor_windows(source: str, s: EditorSettings) -> list[EditorWindow]:
    """`s.requests` windows, the cursor at window_chars + i x step_chars (the first window full). Each
    window starts window_chars before its cursor, moved back to a multiple of anchor_chars and then to
    that line's start (anchor_chars 0: exactly window_chars before the cursor)."""
    needed = s.window_chars + (s.requests - 1) * s.step_chars
    if len(source) < needed:
        raise SpecstackError(f"{s.source} has {len(source)} characters; the editor needs {needed} (--window-chars + "
                             "(--requests - 1) x --step-chars): pick a longer --source or fewer requests")
    windows = []
    for i in range(s.requests):
        cursor = s.window_chars + i * s.step_chars
        start = cursor - s.window_chars
        if s.anchor_chars:
            start = source.rfind("\n", 0, start // s.anchor_chars * s.anchor_chars) + 1
        windows.append(EditorWindow(start, cursor, source[start:cursor]))
    return windows


# ---------------------------------------------------------------------------------------------------
# prefix-probe
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbePrompt:
    repeat: int
    kind: str  # cold | extended (cold + tail) | n1 | nN (N samples)
    source: str  # the module its text comes from
    text: str
    n: int = 1


def lines_before(text: str, chars: int) -> str:
    """The longest prefix of `text` of at most `chars` characters that ends at a line's end (before its
    newline, so the next text starts with one and the boundary token stays where it is); `chars` if the
    first line is longer."""
    end = text.rfind("\n", 0, chars)
    return text[:end] if end > 0 else text[:chars]


def probe_header(nonce: str, repeat: int, kind: str) -> str:
    """A first line no other prompt has: a hash of (run nonce, repeat, kind) first, so two prompts share
    only `# ` with each other (and nothing with the file the rest comes from)."""
    tag = hashlib.sha256(f"{nonce}/{repeat}/{kind}".encode()).hexdigest()[:12]
    return f"# {tag} probe {kind} {repeat}\n"


def probe_prompts(sources: Sequence[tuple[str, str]], s: ProbeSettings, nonce: str) -> list[ProbePrompt]:
    """Four prompts per repeat r, in sending order: cold and extended from sources[2r] (extended = cold +
    the next ~tail_chars of the file), then n1 and nN from sources[2r + 1] (the same text under two
    headers: the same work, each on a prefix of its own)."""
    if len(sources) < 2 * s.repeats:
        raise SpecstackError(f"--repeats {s.repeats} needs {2 * s.repeats} source files, {len(sources)} are known")
    prompts = []
    for r in range(s.repeats):
        (name, text), (n_name, n_text) = sources[2 * r], sources[2 * r + 1]
        if len(text) < s.probe_chars + s.tail_chars or len(n_text) < s.n_chars:
            short = name if len(text) < s.probe_chars + s.tail_chars else n_name
            raise SpecstackError(f"module {short} is too short for --probe-chars / --tail-chars / --n-chars")
        body = lines_before(text, s.probe_chars)
        tail = lines_before(text[len(body):], s.tail_chars)  # the file's next lines, from the newline on
        cold = probe_header(nonce, r, "cold") + body
        n_body = lines_before(n_text, s.n_chars)
        prompts += [ProbePrompt(r, "cold", name, cold),
                    ProbePrompt(r, "extended", name, cold + tail),
                    ProbePrompt(r, "n1", n_name, probe_header(nonce, r, "n1") + n_body),
                    ProbePrompt(r, "nN", n_name, probe_header(nonce, r, "nN") + n_body, n=s.n)]
    return prompts
