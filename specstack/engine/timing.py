"""Timed forwards of a loaded target that leave its committed cache unchanged: the one procedure
behind the engine's forward-cost curves (engine/batch_cost.py), `specstack bench-forward` and the
throughput model's calibration. A forward writes scratch slots only (cache.py), so every repeat runs
at the same context. One row (`forward_steps`: chains and trees) or many (`RowForwards`: B rows of
chains, uniform or ragged in either layout of attention.row_blocks_batch)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Literal

import torch

from specstack.attention import Layout, build_batch, row_blocks_batch, tree_batch
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel

ForwardStep = Callable[[torch.Tensor], None]  # one forward of tokens [B, T] ([1, N] packed) at the context, rolled back


def random_context(n: int, vocab_size: int) -> list[int]:
    """n seeded random token ids (a context whose text does not matter: a forward's time does not
    depend on the values)."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def tree_parents(t: int) -> list[int]:
    """A fixed binary draft tree of t nodes in breadth-first order: two children of the root, then
    two children per node (depth about log2 t)."""
    return [-1 if i < 2 else i // 2 - 1 for i in range(t)]


def forward_steps(lm: LoadedModel, ctx: list[int], max_t: int) -> dict[str, ForwardStep]:
    """Prefill ctx once; return chain and tree forwards that leave the committed cache unchanged."""
    model = lm.model
    cache = model.new_cache(1, len(ctx) + max_t)
    model.extend(torch.tensor([ctx], device=model.device), cache)
    committed = list(cache.lengths)

    def check() -> None:
        if cache.lengths != committed:  # forwards write scratch only (cache.py); guard the premise
            raise SpecstackError(f"cache length moved from {committed} to {cache.lengths}")

    def chain(tokens: torch.Tensor) -> None:
        model.forward(tokens, build_batch(cache, tokens.shape[1]), cache)
        check()

    def tree(tokens: torch.Tensor) -> None:
        model.forward(tokens, tree_batch(cache, tree_parents(tokens.shape[1])), cache)
        check()

    return {f"specstack {lm.fmt} chain": chain, f"specstack {lm.fmt} tree": tree}


# Tokens per prefill forward of the shared context (bounds the activations of a long context's prefill)
PREFILL_TOKENS = 4096


class RowForwards:
    """Forwards of B rows that all hold the same committed context and leave the cache unchanged: the
    batched engine's step (engine/batched.py) at a fixed context. One cache of `max_rows` rows is
    filled once (one row prefilled, its keys/values copied to the others); `keep(b)` drops rows from
    the end (O(1): the last row moves nowhere), so a sweep from the most rows down reuses that fill
    for every B."""

    def __init__(self, lm: LoadedModel, ctx: list[int], max_rows: int, scratch: int) -> None:
        if max_rows < 1:
            raise ValueError(f"need at least one row, got {max_rows}")
        self.model = model = lm.model
        # max_rows allocated up front, as the engine does: B live rows of max_rows, same strides
        self.cache = model.new_cache(1, len(ctx) + scratch, max_rows=max_rows)
        ids = torch.tensor([ctx], device=model.device)
        for i in range(0, len(ctx), PREFILL_TOKENS):  # no logits: they are not timed and would be T x vocab
            model.extend(ids[:, i : i + PREFILL_TOKENS], self.cache, logit_rows=slice(0, 0))
        # every row holds the same context, so the rows' keys/values are row 0's: copying them costs
        # one memory copy a row instead of a prefill a row (16 rows x 256 tokens: 40 s of bf16 on 2 cores)
        for _ in range(1, max_rows):
            self.cache.copy_row(0)
        self.committed = list(self.cache.lengths)

    @property
    def rows(self) -> int:
        return self.cache.batch_size

    def keep(self, rows: int) -> None:
        """Keep the first `rows` rows (fewer than now, or as many)."""
        if not 1 <= rows <= self.rows:
            raise ValueError(f"cannot keep {rows} of {self.rows} rows (rows are only dropped)")
        while self.rows > rows:
            self.cache.remove_row(self.rows - 1)
        self.committed = self.committed[:rows]

    def _check(self) -> None:
        if self.cache.lengths != self.committed:  # forwards write scratch only (cache.py); guard the premise
            raise SpecstackError(f"cache length moved from {self.committed} to {self.cache.lengths}")

    def chain(self, tokens: torch.Tensor) -> None:
        """tokens [B, T]: every row continues its context by a chain of T tokens (logits for all, as a
        verify step of chains needs them)."""
        self.model.forward(tokens, build_batch(self.cache, tokens.shape[1]), self.cache)
        self._check()

    def ragged(self, counts: Sequence[int], layout: Layout,
               logits: Literal["last", "all"] = "last") -> Callable[[torch.Tensor], torch.Tensor]:
        """A forward of chains of counts[b] tokens per row in `layout` ("pad": tokens [B, max count],
        "split": packed [1, sum]) that returns the logits of each row's last token ([B, V]: what the
        engine asks of a prompt chunk) or, `logits="all"`, of every token ([sum, V]: what it asks of a
        root and its draft, to verify them). The step's tokens come from `ragged_tokens`; it builds the
        metadata and the index each call, as an engine step does."""
        if len(counts) != self.rows:
            raise ValueError(f"{len(counts)} row counts for {self.rows} rows")
        parents = [list(range(-1, n - 1)) for n in counts]
        width = max(counts)
        starts = [0, *accumulate(counts[:-1])] if layout == "split" else [b * width for b in range(len(counts))]
        wanted = [s + j for s, n in zip(starts, counts, strict=True) for j in range(0 if logits == "all" else n - 1, n)]
        dev = self.model.device

        def step(tokens: torch.Tensor) -> torch.Tensor:
            batch = row_blocks_batch(self.cache, parents, layout)
            index = torch.tensor(wanted, dtype=torch.long, device=dev)
            out = self.model.forward(tokens, batch, self.cache, logit_rows=index).logits[0]
            self._check()
            return out

        return step




def ragged_tokens(counts: Sequence[int], layout: Layout, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random token ids for `RowForwards.ragged`: [B, max count] padded with 0 ("pad") or [1, sum] ("split")."""
    if layout == "split":
        return torch.randint(0, vocab_size, (1, sum(counts)), generator=generator)
    width = max(counts)
    ids = torch.randint(0, vocab_size, (len(counts), width), generator=generator)
    ids[torch.arange(width).unsqueeze(0) >= torch.tensor(counts).unsqueeze(1)] = 0
    return ids
