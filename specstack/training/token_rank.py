"""The draft vocabulary of FR-Spec (Zhao et al. 2025): a target's tokens ranked by how often they occur
in a corpus, counted with its own tokenizer. `--draft-vocab K` restricts a draft's head to the first K
(models/transformer.py, `with_head_over`); the ranking ships per model (models/registry.py,
`token_rank`), made by benchmarks/draft_vocab.py from the standard library and ShareGPT (never from
the benchmark's own solutions)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np


def rank_tokens(tokenize: Callable[[str], list[int]], texts: Iterable[str], vocab_size: int,
                keep: int) -> tuple[np.ndarray, int]:
    """The `keep` most frequent token ids of `texts` (most frequent first; ties by id) and the number
    of tokens counted. Tokens never seen rank after every seen one, by id."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    total = 0
    for text in texts:
        ids = np.asarray(tokenize(text), dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        np.add.at(counts, ids, 1)
        total += len(ids)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return order[:keep].astype(np.int32), total


def save_rank(path: Path, ranked: np.ndarray) -> None:
    np.save(path, ranked.astype(np.int32))
