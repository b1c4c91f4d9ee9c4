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
        probs = probs.masked_fill(nucleus_drop(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def nucleus_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] -> the tokens top-p drops [..., V] (bool): all but the shortest prefix of the
    tokens in descending probability (ties in index order) whose mass reaches top_p, and never the
    first (a top_p below float32's smallest value rounds to 0 in the comparison, which would drop
    every token; transformers' min_tokens_to_keep=1 does the same).

    Sorting a 150k vocabulary costs more than a model's step on a CPU; the prefix is decided by the
    largest few probabilities unless the distribution is flat, so the candidates are the top
    `_NUCLEUS_FIRST` (torch.topk, a partial selection) and grow only while the prefix could reach
    past the tokens they surely contain; the whole sort is the last resort."""
    flat = probs.reshape(-1, probs.shape[-1])
    V = flat.shape[-1]
    drop = torch.ones_like(flat, dtype=torch.bool)
    rows = torch.arange(flat.shape[0], device=flat.device)  # the rows not decided yet
    k = min(V, _NUCLEUS_FIRST)
    while True:
        vals, idx = _descending(flat[rows], k)
        # the prefix's length: 1 + the positions whose inclusive mass stays below top_p (a cumsum of
        # non-negatives is monotone, so this is a prefix); at most every candidate
        n_keep = ((vals.cumsum(-1) < top_p).sum(-1, keepdim=True) + 1).clamp(max=k)
        keep = torch.arange(k, device=flat.device) < n_keep
        if k == V:
            drop[rows] = drop[rows].scatter_(-1, idx, ~keep)
            break
        # the candidates surely hold every token above the smallest candidate's probability, in the
        # whole order's positions; where the prefix ends inside those (or the rest is all zero) the
        # candidates decide the row; the others look again at more
        last = vals[:, -1:]
        decided = ((n_keep <= (vals > last).sum(-1, keepdim=True)) | (last == 0)).squeeze(-1)
        done = rows[decided]
        drop[done] = drop[done].scatter_(-1, idx[decided], ~keep[decided])
        rows = rows[~decided]
        if not rows.numel():
            break
        k = min(V, k * _NUCLEUS_GROWTH)
    return drop.view(probs.shape)


# candidates top-p looks at first, and the factor it widens them by (a torch.topk of 16k of a 150k
# vocabulary still costs a tenth of a sort)
_NUCLEUS_FIRST = 1024
_NUCLEUS_GROWTH = 16


def _descending(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of flat [N, V], in descending order with ties in index order (a
    stable sort's order, whatever order torch.topk leaves equal values in): values and indices."""
    if k == flat.shape[-1]:
        return torch.sort(flat, dim=-1, descending=True, stable=True)
    vals, idx = torch.topk(flat, k, dim=-1)
    idx, by_index = idx.sort(-1)
    vals, order = vals.gather(-1, by_index).sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [N, V] (the first index on ties, NaN above all, as torch's).
    On the CPU through NumPy, whose argmax is vectorised where torch's is a scalar loop over the row:
    at one row of a small model this is a visible share of the step."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    # (each torch call right after a forward costs tens of microseconds: benchmarks/after_forward.py)
    rows = logits if logits.dtype == torch.float32 and not logits.requires_grad else logits.detach().float()
    return rows.numpy().argmax(-1).tolist()


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

