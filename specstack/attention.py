"""Attention metadata and the one place attention masks are built (DESIGN §2.3).

A forward over a block of T new tokens per row sees [committed cache slots | the block itself].
What a query may attend to is the conjunction of:
- committed slots of its own row (never scratch left by earlier forwards),
- inside the block, the query's ancestors-or-self: a causal triangle for ordinary sequences,
  the ancestor mask of a draft tree, and nothing of the padding of shorter rows (ragged batches),
- the sliding window of the cache, if any: key position < sink, or query pos - key pos < window.

Besides the batches of the engine's forwards (build_batch, tree_batch), the mask pieces other code
needs come from here too: a draft tree grown block by block in a round's scratch (scratch_tree_mask,
the model drafters), the window rule alone (window_mask) and the masks of a SPIRe draft's unrolled
training forward (unrolled_step_mask).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstack.cache import KVCache
from specstack.config import WindowSpec


@dataclass(frozen=True)
class AttentionBatch:
    """What a forward needs besides the tokens: positions [B, T] and the boolean mask
    [B, 1, T, S] over the cache slots S = longest row + T (True = may attend)."""

    positions: torch.Tensor
    # None when no mask is needed: with is_causal, a causal block over an empty cache (SDPA's
    # is_causal path); without, one new token per row that sees every committed slot (decode).
    mask: torch.Tensor | None
    n_valid: tuple[int, ...]  # real (non-padding) tokens per row
    is_causal: bool = False
    append: bool = False  # the block continues this round's scratch instead of starting anew

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]


def causal_block_mask(t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril_()


def ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, n] mask of ancestors-or-self from parent pointers (-1 = child of the root).
    Nodes must be topologically ordered (parent index < child index); a node's row is its
    parent's row plus itself, so one pass suffices."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: nodes must follow their parents")
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m.to(device)


def scratch_tree_mask(paths: Sequence[Sequence[int]], trunk: int, width: int) -> torch.Tensor:
    """[T, width] block mask (build_batch's, with append) for T tree nodes appended to a round's
    scratch, which already holds width - T slots: a chain (`trunk` slots: a draft's pending tokens up
    to the root, which every node continues), then nodes of the tree written by earlier blocks.
    Row j sees the trunk and exactly paths[j]: the scratch slots of node j and of its ancestors in
    the tree (in any order; each written by this block or an earlier one)."""
    mask = torch.zeros(len(paths), width, dtype=torch.bool)
    mask[:, :trunk] = True
    rows = [j for j, path in enumerate(paths) for _ in path]
    mask[rows, [slot for path in paths for slot in path]] = True
    return mask


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: WindowSpec | None) -> torch.Tensor:
    """[..., Tq, Tk] the sliding-window rule: a query at q_pos [..., Tq] sees a key at k_pos [..., Tk]
    when the key is one of the first `sink` positions or fewer than `window` positions back (leading
    dimensions broadcast). window None: every key."""
    if window is None:
        lead = torch.broadcast_shapes(q_pos.shape[:-1], k_pos.shape[:-1])
        return torch.ones(*lead, q_pos.shape[-1], k_pos.shape[-1], dtype=torch.bool, device=q_pos.device)
    dist = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    return (k_pos.unsqueeze(-2) < window.sink) | (dist < window.window)


def unrolled_step_mask(pos: torch.Tensor, step: int, window: WindowSpec | None) -> torch.Tensor:
    """[T, (step + 1) * T] mask of draft step `step` (1, 2, ...) of a SPIRe draft's training forward,
    which runs k chained draft steps over a whole sequence at once (positions pos [T] = 0..T-1).
    Keys: [target memories of every position | the draft's own memories from steps step - 1, ..., 1
    | this step's tokens]. The query at t sees the target's memories before t - step + 1 (the verified
    context), from step step - r the memory at t - r for r = 1..step-1 (the tokens a chain of drafts
    made itself) and itself: exactly what the engine's step-th draft forward sees. Within the window."""
    t = pos.shape[0]
    seen = window_mask(pos, pos, window)
    diag = torch.eye(t, dtype=torch.bool, device=pos.device)
    masks = [seen & (pos.unsqueeze(1) - pos.unsqueeze(0) >= step)]
    masks += [seen & torch.roll(diag, -r, dims=1).tril(-r) for r in range(1, step)]
    return torch.cat(masks + [diag], dim=1)


def depths_from_parents(parents: Sequence[int]) -> list[int]:
    """Depth of each node; children of the root have depth 1."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def build_batch(
    cache: KVCache,
    num_tokens: int,
    block_mask: torch.Tensor | None = None,
    block_offsets: torch.Tensor | None = None,
    n_valid: Sequence[int] | None = None,
    append: bool = False,
) -> AttentionBatch:
    """Metadata for a forward of `num_tokens` new tokens per row.

    block_mask: [T, T] or [B, T, T] mask inside the block (default causal). With `append`, the block
        follows the P scratch tokens already written this round and the mask is [.., T, P + T]
        (default: all of the scratch, then causal).
    block_offsets: [T] or [B, T] position offsets of the block tokens from each row's next position
        (default 0..T-1, or P..P+T-1 with `append`; a tree passes depth - 1).
    n_valid: real tokens per row (default all T). Padding (the last T - n_valid[b] tokens of a row) is
        never visible to real queries; padded queries see at least themselves (no empty mask rows), and
        their positions are the row's next position.
    """
    b, t = cache.batch_size, num_tokens
    dev = cache.device
    n_valid_t = tuple(n_valid) if n_valid is not None else (t,) * b
    if len(n_valid_t) != b or any(not 0 <= n <= t for n in n_valid_t):
        raise ValueError(f"n_valid {n_valid_t} does not fit {b} rows of {t} tokens")
    prior = cache.scratch if append else 0
    start = torch.tensor(cache.next_pos, device=dev).unsqueeze(1)
    offsets = torch.arange(prior, prior + t, device=dev) if block_offsets is None else block_offsets.to(dev)
    positions = start + offsets.expand(b, t)
    if any(n < t for n in n_valid_t):
        # padding sits at the row's next position: a padded row near the context limit must not index
        # past the position tables (its padding is never committed, so the position is immaterial)
        pad = torch.arange(t, device=dev).unsqueeze(0) >= torch.tensor(n_valid_t, device=dev).unsqueeze(1)
        positions = positions.masked_fill(pad, 0) + start * pad

    plain = (block_mask is None and block_offsets is None and cache.window is None and min(n_valid_t) == t
             and not append)
    if plain and max(cache.lengths) == 0:
        return AttentionBatch(positions, None, n_valid_t, is_causal=True)
    if plain and t == 1 and min(cache.lengths) == max(cache.lengths):
        return AttentionBatch(positions, None, n_valid_t)

    if block_mask is None:
        inner = causal_block_mask(t, dev)
        if prior:
            inner = torch.cat([torch.ones(t, prior, dtype=torch.bool, device=dev), inner], dim=1)
    else:
        inner = block_mask.to(dev)
    if inner.shape[-2:] != (t, prior + t):
        raise ValueError(f"block mask of shape {tuple(inner.shape)} for {t} tokens after {prior} in scratch")
    inner = inner.expand(b, t, prior + t).clone()
    valid = torch.arange(t, device=dev).unsqueeze(0) < torch.tensor(n_valid_t, device=dev).unsqueeze(1)
    inner[:, :, prior:] &= valid.unsqueeze(1)  # no query sees padding
    inner[:, :, prior:] |= torch.eye(t, dtype=torch.bool, device=dev)  # every query sees itself

    lengths = torch.tensor(cache.lengths, device=dev)
    s_used = max(cache.lengths) + prior + t
    slots = torch.arange(s_used, device=dev).unsqueeze(0)
    mask = (slots < lengths.unsqueeze(1)).unsqueeze(1).expand(b, t, s_used).clone()
    block_slots = (lengths.unsqueeze(1) + torch.arange(prior + t, device=dev)).unsqueeze(1).expand(b, t, prior + t)
    mask.scatter_(2, block_slots, inner)

    if cache.window is not None:
        # Keys of the block get their positions when written; use the block's positions here.
        key_pos = cache.slot_pos[:, :s_used].clone()
        key_pos.scatter_(1, block_slots[:, 0, prior:], positions)
        mask &= window_mask(positions, key_pos, cache.window)
    return AttentionBatch(positions, mask.unsqueeze(1), n_valid_t, append=append)


def tree_batch(cache: KVCache, parents: Sequence[int], new_from: int = 0) -> AttentionBatch:
    """A draft tree hanging off every row's last committed token (same tree shape in each row).
    With new_from = k > 0, nodes [0, k) are already in this round's scratch and only nodes [k, n)
    form the block (a tree grown level by level)."""
    depth = torch.tensor(depths_from_parents(parents), device=cache.device)
    if new_from and new_from != cache.scratch:
        raise ValueError(f"{new_from} tree nodes claimed in scratch, but it holds {cache.scratch}")
    mask = ancestor_mask(parents, cache.device)[new_from:]
    return build_batch(cache, len(parents) - new_from, mask, depth[new_from:] - 1, append=new_from > 0)
