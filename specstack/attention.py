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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from specstack.cache import KVCache
from specstack.config import WindowSpec

Layout = Literal["pad", "split"]
LAYOUTS: tuple[Layout, ...] = ("pad", "split")


@dataclass(frozen=True)
class RowRun:
    """Rows [start, stop) of a packed block attended in one call. Their tokens are the packed block's
    [first, first + their count). Either every row carries `tokens` tokens, or (`gather` set) the rows
    carry short blocks of different sizes, padded to `tokens` queries for the call: a batch whose rows
    verify drafts of 1, 2, 3 ... tokens in any order would otherwise make one call per stretch of equal
    rows, in every layer (32 rows: ~20 calls a layer, their dispatch costing more than the attention)."""

    start: int
    stop: int
    tokens: int
    first: int
    keys: int  # cache slots the run's queries may see (its longest row + its tokens)
    mask: torch.Tensor | None  # [R, 1, tokens, keys]; None: see below (AttentionBatch.mask)
    is_causal: bool = False
    # padded runs: the packed index of each of the R * tokens queries (a padding query repeats its row's
    # first token, so its mask row is a real one), and which of them are real, in packed order
    gather: torch.Tensor | None = None
    real: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionBatch:
    """What a forward needs besides the tokens: positions [B, T] and the boolean mask
    [B, 1, T, S] over the cache slots S = longest row + T (True = may attend).

    Two layouts of a ragged batch (rows with different numbers of new tokens, DESIGN §6):
    - PAD: every row's block padded to the longest (n_valid says how much is real); one attention call;
    - SPLIT: no padding. The rows' tokens are packed into one flat block, positions [1, N] (row 0's
      tokens, then row 1's, ...), `counts` tokens a row, and attention runs once per run of
      consecutive rows with equal counts, or of consecutive rows of 1..PAD_RUN_TOKENS tokens padded to
      the longest of them (`runs`); the linear layers see N tokens, not B * T."""

    positions: torch.Tensor
    # None when no mask is needed: with is_causal, a causal block over an empty cache (SDPA's
    # is_causal path); without, one new token per row that sees every committed slot (decode).
    mask: torch.Tensor | None
    n_valid: tuple[int, ...]  # real (non-padding) tokens per row
    is_causal: bool = False
    append: bool = False  # the block continues this round's scratch instead of starting anew
    runs: tuple[RowRun, ...] | None = None  # SPLIT layout (see above); None: [B, T]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def counts(self) -> tuple[int, ...] | None:
        """Tokens per row of a packed (SPLIT) block, None for a [B, T] block."""
        return self.n_valid if self.runs is not None else None


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
    cache.check_room(prior + t)  # a growable cache grows before the mask reads its slots
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

    mask = _slot_mask(cache, range(b), inner, positions, prior)
    return AttentionBatch(positions, mask, n_valid_t, append=append)


def _slot_mask(cache: KVCache, rows: range, inner: torch.Tensor, positions: torch.Tensor,
               prior: int) -> torch.Tensor:
    """[R, 1, T, S] over the cache slots of `rows`: each row's committed slots, then its block
    [P scratch slots written earlier this round | the T new tokens] masked by inner [R, T, P + T],
    all within the cache's window (S = longest of the rows + P + T)."""
    dev = cache.device
    t = inner.shape[1]
    row_lengths = [cache.lengths[r] for r in rows]
    lengths = torch.tensor(row_lengths, device=dev)
    s_used = max(row_lengths) + prior + t
    slots = torch.arange(s_used, device=dev).unsqueeze(0)
    mask = (slots < lengths.unsqueeze(1)).unsqueeze(1).expand(len(rows), t, s_used).clone()
    block_slots = (lengths.unsqueeze(1) + torch.arange(prior + t, device=dev)).unsqueeze(1).expand(
        len(rows), t, prior + t)
    mask.scatter_(2, block_slots, inner)

    if cache.window is not None:
        # Keys of the block get their positions when written; use the block's positions here.
        key_pos = cache.slot_pos[rows.start:rows.stop, :s_used].clone()
        key_pos.scatter_(1, block_slots[:, 0, prior:], positions)
        mask &= window_mask(positions, key_pos, cache.window)
    return mask.unsqueeze(1)


def tree_batch(cache: KVCache, parents: Sequence[int], new_from: int = 0) -> AttentionBatch:
    """A draft tree hanging off every row's last committed token (same tree shape in each row).
    With new_from = k > 0, nodes [0, k) are already in this round's scratch and only nodes [k, n)
    form the block (a tree grown level by level)."""
    depth = torch.tensor(depths_from_parents(parents), device=cache.device)
    if new_from and new_from != cache.scratch:
        raise ValueError(f"{new_from} tree nodes claimed in scratch, but it holds {cache.scratch}")
    mask = ancestor_mask(parents, cache.device)[new_from:]
    return build_batch(cache, len(parents) - new_from, mask, depth[new_from:] - 1, append=new_from > 0)


def _chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def row_blocks_batch(cache: KVCache, parents: Sequence[Sequence[int]], layout: Layout = "pad") -> AttentionBatch:
    """A ragged block: row b's new tokens form a tree given by parents[b] (parent pointers within the
    row's block, -1: continues the row's committed tokens; a chain [-1, 0, 1, ...] is a prompt chunk
    or a decode step, [-1, 0, 0, 1, ...] a root with a draft tree). Rows may carry different numbers
    of tokens (0: the row sits this forward out). PAD pads every row to the longest; SPLIT packs the
    tokens (see AttentionBatch). Token j of row b sits at position next_pos[b] + depth(j) - 1."""
    b = cache.batch_size
    if len(parents) != b:
        raise ValueError(f"{len(parents)} row blocks for {b} live rows")
    counts = [len(p) for p in parents]
    t = max(counts, default=0)
    if t == 0:
        raise ValueError("a forward needs at least one token")
    chains = all(_chain(p) for p in parents)
    if layout == "pad":
        if chains and min(counts) == t:
            return build_batch(cache, t)  # its mask-free fast paths apply
        inner = torch.zeros(b, t, t, dtype=torch.bool)
        offsets = torch.zeros(b, t, dtype=torch.long)
        for r, par in enumerate(parents):
            if par:
                inner[r, : len(par), : len(par)] = ancestor_mask(par)
                offsets[r, : len(par)] = torch.tensor(depths_from_parents(par)) - 1
        return build_batch(cache, t, inner, offsets, counts)
    if layout != "split":
        raise ValueError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    dev = cache.device
    cache.check_room(t, counts)
    pos_parts: list[torch.Tensor] = []
    for r, par in enumerate(parents):
        if par:
            pos_parts.append(cache.next_pos[r] + torch.tensor(depths_from_parents(par)) - 1)
    positions = torch.cat(pos_parts).to(dev).unsqueeze(0)
    runs: list[RowRun] = []
    r, first = 0, 0
    while r < b:
        n = counts[r]
        stop = r + 1
        while stop < b and counts[stop] == n:
            stop += 1
        short = stop  # the rows of short blocks that follow join this run's call
        while 0 < n <= PAD_RUN_TOKENS and short < b and 0 < counts[short] <= PAD_RUN_TOKENS:
            short += 1
        if short > stop:  # short blocks of different sizes: one padded call
            rows = range(r, short)
            runs.append(_padded_run(cache, [ancestor_mask(parents[i]) for i in rows], rows, first, positions[0]))
            first += sum(counts[r:short])
            r = short
            continue
        if n:
            rows = range(r, stop)
            lens = [cache.lengths[i] for i in rows]
            keys = max(lens) + n
            block = parents[r:stop]
            mask, causal = None, False
            plain = cache.window is None and all(_chain(p) for p in block)
            if plain and max(lens) == 0:
                causal = True
            elif not (plain and n == 1 and min(lens) == max(lens)):
                inner = torch.stack([ancestor_mask(p) for p in block]).to(dev)
                mask = _slot_mask(cache, rows, inner, positions[0, first : first + len(rows) * n].view(len(rows), n), 0)
            runs.append(RowRun(r, stop, n, first, keys, mask, causal))
        first += (stop - r) * n
        r = stop
    return AttentionBatch(positions, None, tuple(counts), runs=tuple(runs))


def _padded_run(cache: KVCache, inners: Sequence[torch.Tensor], rows: range, first: int, positions: torch.Tensor,
                prior: int = 0) -> RowRun:
    """Rows of blocks (inners[k]: row rows[k]'s block mask [c, prior + c], build_batch's, its c >= 1 tokens
    packed from `first` on) as one call of max(c) queries a row: row r's query j < c is its token j; past
    that (blocks of different sizes) it repeats the row's first token (its position; it sees that token
    only), and its output is dropped."""
    dev = cache.device
    n = max(m.shape[0] for m in inners)
    keys = max(cache.lengths[i] for i in rows) + prior + n
    if all(m.shape[0] == n for m in inners):  # nothing to pad: the queries as they are packed, no gather
        pos = positions[first : first + len(rows) * n].view(len(rows), n)
        return RowRun(rows.start, rows.stop, n, first, keys, _slot_mask(cache, rows, torch.stack(inners).to(dev), pos, prior))
    gather, real, inner = [], [], torch.zeros(len(rows), n, prior + n, dtype=torch.bool)
    at = first
    for k, m in enumerate(inners):
        c = m.shape[0]
        inner[k, :c, : prior + c] = m
        inner[k, c:, prior] = True
        gather += [at + j for j in range(c)] + [at] * (n - c)
        real += [k * n + j for j in range(c)]
        at += c
    index = torch.tensor(gather, device=dev)
    pos = positions[index].view(len(rows), n)
    mask = _slot_mask(cache, rows, inner.to(dev), pos, prior)
    return RowRun(rows.start, rows.stop, n, first, keys, mask, gather=index, real=torch.tensor(real, device=dev))


def packed_append_batch(cache: KVCache, masks: Sequence[torch.Tensor | None],
                        offsets: Sequence[torch.Tensor | None]) -> AttentionBatch:
    """Row b's new tokens appended to this round's scratch (P = cache.scratch slots written by earlier
    blocks), packed without padding (positions [1, N], row 0's tokens first): masks[b] [n_b, P + n_b] is
    its block mask (build_batch's with append), offsets[b] [n_b] their positions from the row's next
    position; None: the row takes no tokens. The linear layers see the N real tokens; attention is one
    call a stretch of consecutive rows that take tokens, padded to its widest row where widths differ
    (`_padded_run`): a draft group's levels differ in width from row to row, and a row whose tree is
    grown takes none (drafting/batched_tree.py)."""
    prior, b = cache.scratch, cache.batch_size
    if len(masks) != b or len(offsets) != b:
        raise ValueError(f"{len(masks)} row blocks for {b} live rows")
    counts = [0 if m is None else m.shape[0] for m in masks]
    if sum(counts) == 0:
        raise ValueError("a forward needs at least one token")
    for m, o, n in zip(masks, offsets, counts, strict=True):
        if m is not None and (tuple(m.shape) != (n, prior + n) or o is None or o.shape != (n,)):
            raise ValueError(f"a block of {n} tokens after {prior} in scratch needs a [{n}, {prior + n}] mask "
                             f"and {n} offsets")
    cache.check_room(prior + max(counts))  # the padded calls see the widest row's slots in every row
    dev = cache.device
    positions = torch.cat([cache.next_pos[r] + o for r, o in enumerate(offsets) if o is not None]).to(dev)
    runs: list[RowRun] = []
    r, first = 0, 0
    while r < b:
        if not counts[r]:
            r += 1
            continue
        stop = r + 1
        while stop < b and counts[stop]:
            stop += 1
        rows = range(r, stop)
        runs.append(_padded_run(cache, [m for m in masks[r:stop] if m is not None], rows, first, positions, prior))
        first += sum(counts[r:stop])
        r = stop
    return AttentionBatch(positions.unsqueeze(0), None, tuple(counts), append=True, runs=tuple(runs))


# Rows carrying up to this many tokens share one padded attention call in SPLIT (RowRun): with at most
# MATMUL_QUERIES queries a row it runs as two matmuls, where padding a row costs little
PAD_RUN_TOKENS = 4

# Queries per row up to which CPU attention runs as two batched matmuls (grouped-query heads folded
# into the query rows) rather than SDPA's flash kernel, which tiles for long query blocks: short
# queries over a few hundred keys make whole forwards of the default model faster (docs/bench-history,
# "Batched decoding").
MATMUL_QUERIES = 4


# q [B, H, T, D], k, v [B, Hkv, S, D], mask [B, 1, T, S] or None, is_causal -> [B, H, T, D]: one attention
# call (`attend` makes one per run of rows); a model may bring its own (models/fixed_attention.py)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, Hkv, S, D] (grouped-query: H a multiple of Hkv) -> [B, H, T, D]."""
    b, h, t, d = q.shape
    if t <= MATMUL_QUERIES and not is_causal and q.device.type == "cpu":
        hkv = k.shape[1]
        g = h // hkv  # query heads per key/value head: heads kv * g .. kv * g + g - 1 share kv
        scores = torch.matmul(q.reshape(b, hkv, g * t, d), k.transpose(-1, -2)).mul_(d**-0.5)
        if mask is not None:
            scores = scores.view(b, hkv, g, t, -1).masked_fill_(~mask.unsqueeze(1), float("-inf"))
        return torch.matmul(torch.softmax(scores.view(b, hkv, g * t, -1), -1), v).view(b, h, t, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: AttentionBatch,
           kernel: AttentionFn | None = None) -> torch.Tensor:
    """The attention of a forward, for either layout: q [B, T, H, D] (the block's queries, [1, N, H, D]
    when packed), keys/values [B, Hkv, S, D] from the cache -> [B * T, H * D]. kernel: the model's own
    attention call (default: torch's, in the cache's dtype)."""
    b, t, h, d = q.shape
    act = q.dtype
    q = q.to(keys.dtype)
    run_one = kernel or _attention
    if batch.runs is None:
        a = run_one(q.transpose(1, 2), keys, values, batch.mask, batch.is_causal)
        return a.transpose(1, 2).reshape(b * t, h * d).to(act)
    out = q.new_empty(t, h, d)
    for run in batch.runs:
        rows, n = run.stop - run.start, run.tokens
        kr, vr = keys[run.start : run.stop, :, : run.keys], values[run.start : run.stop, :, : run.keys]
        if run.gather is not None:  # padded short blocks: gather the queries, keep the real outputs
            qr = q[0, run.gather].view(rows, n, h, d).transpose(1, 2)
            a = run_one(qr, kr, vr, run.mask, run.is_causal).transpose(1, 2).reshape(rows * n, h, d)
            out[run.first : run.first + len(run.real)] = a[run.real]
            continue
        span = slice(run.first, run.first + rows * n)
        qr = q[0, span].view(rows, n, h, d).transpose(1, 2)
        a = run_one(qr, kr, vr, run.mask, run.is_causal)
        out[span] = a.transpose(1, 2).reshape(rows * n, h, d)
    return out.view(t, h * d).to(act)
