"""How `specstack generate` shows many rows (several prompts, or --n samples of one): each row's text on
stdout in input order, a stats line per row and one total line on stderr, a progress bar of finished
rows while they decode.

A row is one generation: prompt P's sample S (both counted from 0 here and in the JSON lines, from 1 in
the headers people read). Rows finish in any order (a short one leaves the batch early); the printer
holds a finished row back until every row before it is out, so stdout always reads in input order
and a consumer of `--jsonl` may pair line k with row k. Standard library only (the CLI's light
contract: common.py): the results are read through their attributes.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specstack.engine.stats import GenerationResult


@dataclass(frozen=True)
class RowKey:
    prompt: int  # index of the prompt, from 0
    sample: int  # index of the sample of that prompt, from 0
    seed: int | None  # the row's sampling seed (--seed + sample), None when unseeded

    def label(self) -> str:
        return f"prompt {self.prompt + 1}, sample {self.sample + 1}"


def header(key: RowKey, result: GenerationResult) -> str:
    """`### prompt 3, sample 2 (finish: length, 128 tokens)`: the line before a row's text."""
    return f"### {key.label()} (finish: {result.finish_reason}, {len(result.tokens)} tokens)"


def row_record(key: RowKey, result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {"prompt_index": key.prompt, "sample": key.sample, "seed": key.seed, "text": result.text,
            "finish_reason": result.finish_reason, "new_tokens": len(result.tokens),
            "prompt_tokens": len(result.prompt_ids), "seconds": round(stats.seconds, 4),
            "tokens_per_s": round(stats.tokens_per_s, 2),
            **({"logprobs": [{"id": lp.token, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
                             for lp in result.logprobs]} if result.logprobs is not None else {})}


def json_line(key: RowKey, result: GenerationResult) -> str:
    """One row as one JSON object on one line (json escapes the text's newlines)."""
    return json.dumps(row_record(key, result), ensure_ascii=False)


def plain_block(key: RowKey, result: GenerationResult) -> str:
    """The header, then the text, ending in a newline (added when the text has none)."""
    text = result.text if not result.text or result.text.endswith("\n") else result.text + "\n"
    return f"{header(key, result)}\n{text}"


def total_line(rows: int, new_tokens: int, wall_seconds: float, batch_size: int, phases: dict[str, float]) -> str:
    """rows, new tokens, wall time and tokens/s over the whole batch, the batch size, and where the
    engine's time went (BatchStats.phase_seconds)."""
    rate = new_tokens / wall_seconds if wall_seconds > 0 else 0.0
    split = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
    return (f"{rows} rows: {new_tokens} tokens in {wall_seconds:.2f} s ({rate:.1f} tokens/s; "
            f"batch size {batch_size}; {split})")


class RowPrinter:
    """Prints finished rows in input order: `add(i, result)` as row i finishes; a row waits until all
    rows before it are printed (and is dropped once it is). Text goes to stdout (a header and the text,
    or one JSON line), the row's stats line to stderr through `note` (a progress bar's write, so the
    bar is redrawn below it). `new_tokens` counts every row's tokens for the total line."""

    def __init__(self, keys: list[RowKey], jsonl: bool, note: Any = None) -> None:
        self.keys, self.jsonl = keys, jsonl
        self.note = note or (lambda line: print(line, file=sys.stderr, flush=True))
        self.waiting: dict[int, GenerationResult] = {}
        self.printed = 0
        self.new_tokens = 0

    def add(self, index: int, result: GenerationResult) -> None:
        self.waiting[index] = result
        self.new_tokens += len(result.tokens)
        while self.printed in self.waiting:
            key, ready = self.keys[self.printed], self.waiting.pop(self.printed)
            sys.stdout.write(json_line(key, ready) + "\n" if self.jsonl else plain_block(key, ready))
            sys.stdout.flush()
            self.note(f"{key.label()}: {ready.stats.line()}")
            self.printed += 1
