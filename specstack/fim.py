"""Fill-in-the-middle prompts from a model's own special tokens (DESIGN §8: code completion).

A code model trained for FIM reads the code before and after the cursor between its special tokens and
writes the middle: `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>` for Qwen2.5-Coder. With
other files of the project given, the repository layout (Qwen2.5-Coder's report, §3) comes first:

    <|repo_name|>myproject\\n<|file_sep|>{name}\\n{text}...<|file_sep|>filename\\n<|fim_prefix|>...

The names `myproject` and `filename` are llama.cpp's (its /infill builds the same layout), so a request
sent to either server is the same prompt. Each part is tokenized on its own with special-token text
read as text (code that contains `<|endoftext|>` cannot end the prompt), and the special tokens are
inserted by id. `prompt` (llama.cpp's /infill field: the text typed on the cursor's line) continues the
prefix. A template is a table row; a model names its row in the registry (models/registry.py) or, for
a checkpoint of its own, the first row whose tokens its tokenizer has is used.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specstack.errors import SpecstackError

REPO_NAME = "myproject"  # llama.cpp's, so both servers build the same prompt
CURRENT_FILE = "filename"


@dataclass(frozen=True)
class FimTemplate:
    prefix: str
    suffix: str
    middle: str
    repo: str | None = None  # the repository layout's tokens, where the model has them
    file_sep: str | None = None
    # tokens that end a middle besides the model's EOS (the model may go on to the next file), as
    # llama.cpp's end-of-generation set holds them
    ends: tuple[str, ...] = ()

    def end_ids(self, tokenizer: Any) -> tuple[int, ...]:
        vocab = tokenizer.get_vocab()
        return tuple(sorted({vocab[t] for t in (*self.ends, self.repo, self.file_sep) if t is not None and t in vocab}))


FIM_TEMPLATES: dict[str, FimTemplate] = {
    "qwen": FimTemplate("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>",
                        ("<|endoftext|>", "<|fim_pad|>", "<|im_end|>")),
    "starcoder": FimTemplate("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>",
                             ("<|endoftext|>", "<fim_pad>")),
}


@dataclass(frozen=True)
class ExtraFile:
    """Another file of the project, shown to the model before the one being edited."""

    filename: str
    text: str


@dataclass(frozen=True)
class FimPrompt:
    ids: list[int]
    truncated: bool  # context was dropped to fit (extra files first, then the prefix's start and the suffix's end)


def budget(context: int, new_tokens: int) -> int:
    """Prompt tokens a FIM prompt may take in a row of `context`: what the middle's room leaves, but at
    least half (a long middle does not push the code around the cursor out)."""
    return max(context // 2, context - new_tokens)


def detect(tokenizer: Any) -> str | None:
    """The first template whose three FIM tokens the tokenizer has, or None."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for name, t in FIM_TEMPLATES.items():
        if all(tok in vocab for tok in (t.prefix, t.suffix, t.middle)):
            return name
    return None


def template(tokenizer: Any, name: str | None, model: str) -> FimTemplate:
    """The template named (a registry entry's) or found in the tokenizer; a clear error when the model
    has no FIM tokens."""
    name = name or detect(tokenizer)
    if name is None or tokenizer is None:
        raise SpecstackError(f"the model {model!r} has no fill-in-the-middle tokens: it cannot complete code "
                             "between a prefix and a suffix (use a code model trained for it, e.g. qwen2.5-coder-1.5b)")
    t = FIM_TEMPLATES[name]
    vocab = tokenizer.get_vocab()
    missing = [tok for tok in (t.prefix, t.suffix, t.middle) if tok not in vocab]
    if missing:
        raise SpecstackError(f"the model {model!r}'s tokenizer lacks its fill-in-the-middle tokens {missing}")
    return t


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)


def encode_fim(tokenizer: Any, t: FimTemplate, prefix: str, suffix: str, extra: Sequence[ExtraFile] = (),
               prompt: str = "", budget: int | None = None) -> FimPrompt:
    """The FIM prompt's ids, fitted into `budget` tokens (None: no limit). What does not fit goes in this
    order: the extra files from the first, then the prefix from its start and the suffix from its end,
    three parts prefix to one part suffix (llama.cpp's ratio): the code nearest the cursor stays."""
    vocab = tokenizer.get_vocab()  # a dict built per call: once per prompt
    pre, suf, mid = vocab[t.prefix], vocab[t.suffix], vocab[t.middle]  # template() checked them
    repo, sep = (vocab.get(tok) if tok is not None else None for tok in (t.repo, t.file_sep))
    head: list[int] = []
    if extra and repo is not None and sep is not None:
        head = [repo, *_text_ids(tokenizer, REPO_NAME + "\n")]
        for f in extra:
            head += [sep, *_text_ids(tokenizer, f.filename + "\n"), *_text_ids(tokenizer, f.text)]
        head += [sep, *_text_ids(tokenizer, CURRENT_FILE + "\n")]
    elif extra:  # no layout tokens: the files as plain text before the prefix
        head = _text_ids(tokenizer, "".join(f"# {f.filename}\n{f.text}\n\n" for f in extra))
    # a model that reads every prompt after BOS gets it first (llama.cpp adds it too)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None else []
    before = _text_ids(tokenizer, prefix) + _text_ids(tokenizer, prompt)
    after = _text_ids(tokenizer, suffix)
    fixed = 3 + len(bos)  # the three FIM tokens
    truncated = budget is not None and fixed + len(head) + len(before) + len(after) > budget
    if budget is not None and truncated:
        room = budget - fixed
        if room < 1:
            raise SpecstackError(f"no room for a fill-in-the-middle prompt in {budget} tokens")
        head = head[len(head) - max(0, min(len(head), room - len(before) - len(after))):]
        room -= len(head)
        if len(before) + len(after) > room:
            keep_after = min(len(after), max(room // 4, room - len(before)))
            keep_before = min(len(before), room - keep_after)
            before = before[len(before) - keep_before:]
            after = after[:keep_after]
    out = [*bos, *head, pre, *before, suf, *after, mid]
    return FimPrompt([int(i) for i in out], truncated)
