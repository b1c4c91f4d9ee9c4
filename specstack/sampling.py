"""logits -> warped probabilities, and sampling from them.

`warp` is THE warp (DESIGN §2.2): the target's p and every draft's q pass through it, so that
verification compares the distributions that are actually sampled from.
"""
from __future__ import annotations

import torch

from specstack.config import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32) after temperature, top-k and top-p.
    Greedy (temperature 0) gives the one-hot of the argmax (first index on ties)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it is kept), and always
        # the most likely token: a top_p below float32's smallest value rounds to 0 in the comparison,
        # which would drop every token (as transformers' min_tokens_to_keep=1 does)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of probs [..., V] (non-negative, any positive total) -> [...] token ids.

    The inverse CDF at a uniform draw, in float64: torch.multinomial over one row of a large vocabulary
    costs a visible share of a CPU decode step, a cumsum and one search a small fraction of that
    (docs/bench-history, "The same with top-k 50, temperature 1, and a faster sampler"). A token of
    probability 0 has an empty CDF interval, and the draw is kept below the total, so it is never
    drawn."""
    flat = probs.reshape(-1, probs.shape[-1]).double()
    cdf = flat.cumsum(-1)
    total = cdf[:, -1:]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a row of zero probability mass")
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=flat.device)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).view(probs.shape[:-1])

