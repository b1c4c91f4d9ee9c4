"""Prompt text -> token ids, with the checks every entry point needs."""
from __future__ import annotations

from typing import Any

from specstack.errors import SpecstackError


def encode_prompt(tokenizer: Any, text: str, chat: bool = False) -> list[int]:
    if tokenizer is None:
        raise SpecstackError("this model has no tokenizer: pass token ids instead of text")
    if not text or not text.strip():
        raise SpecstackError("the prompt is empty")
    check_text(text)
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}], what="--chat")
    return list(tokenizer(text, add_special_tokens=True).input_ids)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], what: str = "chat",
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation ({"role", "content"} messages, an assistant's tool calls, tool results) in the
    model's chat template, ending with the assistant's turn opened (what the model continues): the CLI's
    --chat and the server's chat route. tools: the functions the model may call, as the template writes
    them (OpenAI's shape)."""
    if tokenizer is None:
        raise SpecstackError("this model has no tokenizer: pass token ids instead of text")
    if not getattr(tokenizer, "chat_template", None):
        raise SpecstackError(f"{what}: this model's tokenizer has no chat template")
    for m in messages:
        check_text(m["content"])
    if tools and not template_writes_tools(tokenizer):
        raise SpecstackError(f"{what}: this model's chat template does not write tools")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def template_writes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template writes the functions it may call (it reads a `tools` variable)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def check_text(text: str) -> None:
    """`text` can be encoded: a command line that is not valid UTF-8 reaches Python as lone surrogates
    (`\udcff`), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecstackError(f"the prompt is not valid text: {text[e.start:e.end]!r} at character {e.start} "
                             "(not UTF-8)") from None


def check_context(prompt_len: int, max_seq_len: int) -> None:
    if prompt_len == 0:
        raise SpecstackError("the prompt is empty")
    if prompt_len >= max_seq_len:
        raise SpecstackError(
            f"the prompt has {prompt_len} tokens, over the model's context limit of {max_seq_len} "
            "(at least one position must remain for generation)"
        )
