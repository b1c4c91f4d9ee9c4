"""The token-origin view (staged paper, Figure 3): every emitted token coloured by who produced it —
the target itself, the draft model, draft2 (the n-gram model), the context lookup or a grammar's forced
tokens."""
from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

ORIGINS = ("target", "draft", "draft2", "context", "grammar")
ANSI = {"target": "\033[0m", "draft": "\033[34m", "draft2": "\033[32m", "context": "\033[35m", "grammar": "\033[33m"}
CSS = {"target": "#222222", "draft": "#1f5fbf", "draft2": "#138a36", "context": "#a0309a", "grammar": "#b36b00"}
BG = {"target": "#ffffff", "draft": "#e3edfb", "draft2": "#e2f5e7", "context": "#f6e4f5", "grammar": "#fdf0dc"}


def token_pieces(tokenizer: Any, tokens: Sequence[int]) -> list[str]:
    """The text each token adds (decoded incrementally, so multi-byte characters come out whole)."""
    pieces, prev = [], ""
    for i in range(len(tokens)):
        text = tokenizer.decode(list(tokens[: i + 1]), skip_special_tokens=False)
        pieces.append(text[len(prev):] if text.startswith(prev) else text)
        prev = text
    return pieces


def ansi(pieces: Sequence[str], origins: Sequence[str]) -> str:
    legend = " ".join(f"{ANSI[o]}{o}\033[0m" for o in ORIGINS)
    body = "".join(f"{ANSI[o]}{p}" for p, o in zip(pieces, origins, strict=True)) + "\033[0m"
    return f"{body}\n[origins: {legend}]"


def html_page(pieces: Sequence[str], origins: Sequence[str], title: str, summary: str = "") -> str:
    spans = "".join(
        f'<span class="{o}" title="{o}">{html.escape(p)}</span>' for p, o in zip(pieces, origins, strict=True)
    )
    style = "".join(f".{o}{{color:{CSS[o]};background:{BG[o]}}}" for o in ORIGINS)
    counts = {o: sum(1 for x in origins if x == o) for o in ORIGINS}
    legend = " ".join(f'<span class="{o}">{o}: {counts[o]}</span>' for o in ORIGINS)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}"
        f"pre{{white-space:pre-wrap;font-size:14px;line-height:1.5}}{style}</style></head><body>"
        f"<h2>{html.escape(title)}</h2><p>{legend}</p><p>{html.escape(summary)}</p><pre>{spans}</pre></body></html>"
    )
