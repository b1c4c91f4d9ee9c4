"""Timed forwards of a loaded target that leave its committed cache unchanged: the one procedure
behind the engine's width-cost curves (engine/width_cost.py), `specstack bench-forward` and the
throughput model's calibration. A forward writes scratch slots only (cache.py), so every repeat runs
at the same context."""
from __future__ import annotations

from collections.abc import Callable

import torch

from specstack.attention import build_batch, tree_batch
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel

ForwardStep = Callable[[torch.Tensor], None]  # one forward of tokens [1, T] at the context, rolled back


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
