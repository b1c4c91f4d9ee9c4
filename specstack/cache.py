"""Preallocated KV cache written by slot (gpt-fast style), with per-row lengths and tree commit.

Layout: one tensor per K and V of shape [layers, rows, kv_heads, capacity, head_dim], so a commit
moves the accepted nodes of every layer in one indexed copy.

Each row has `length` committed slots; a forward writes its T new keys/values into the scratch slots
[length, length + T) and nothing becomes visible to later forwards until the caller commits:
- `commit_prefix(counts)`: keep the first counts[b] new tokens of each row (prefill, decode, chains);
  no copy at all.
- `commit_nodes(row, node_ids)`: keep an accepted root-to-leaf path of a tree; the accepted nodes are
  compacted to consecutive slots (O(accepted) copies, never the whole cache), the rest is dead.
A forward may also *append* to the scratch of earlier forwards of the same round (a draft model
growing a chain or tree token by token before anything is verified); node ids in `commit_nodes`
then count over the whole scratch.

Keys are stored after RoPE, so a slot carries its position in `slot_pos`; that is what lets the
sliding-window mode evict old slots physically (first `sink` positions plus the last `window`) while
the mask builder in attention.py still reasons in positions.

A cache allocated for its whole capacity is the engine's (the KV budget is checked once); a draft's
grows on demand up to `max_capacity` (`check_room`, which a forward and the mask builders call first),
so a row holds what it read, not the draft model's whole context.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError

# slots a row of a cache that grows on demand starts with
FIRST_SLOTS = 256


def cache_slots(config: ModelConfig, capacity: int | None, max_capacity: int | None) -> tuple[int, int]:
    """(slots allocated, slots a row may grow to) of a model's new cache: a given capacity is allocated
    and fixed unless max_capacity allows more; without one the cache starts small and grows up to
    max_capacity (default: the context plus one block of scratch, where a tree or padded rows sit)."""
    most = max_capacity or capacity or config.max_seq_len + 64
    return (min(FIRST_SLOTS, most) if capacity is None else capacity), most


@dataclass(frozen=True)
class WriteSlots:
    """KVCache.write's targets for the current block: the caches [layers, rows, Hkv, S, D]; the one row's
    slots (write_idx; with `one_row`, of several rows allocated), else each token's (row, slot); the slots a
    query may see (S = longest row + scratch)."""

    k: torch.Tensor
    v: torch.Tensor
    write_idx: torch.Tensor | None
    rows: torch.Tensor | None
    slots: torch.Tensor | None
    one_row: bool
    s_used: int


def widened(old: torch.Tensor, dim: int, new: int, fill: float = 0) -> torch.Tensor:
    """`old` with `new` entries along `dim`, its own first (a cache's per-slot tensor as the cache grows)."""
    shape = list(old.shape)
    used = shape[dim]
    shape[dim] = new
    # a plain tensor even when a forward in inference mode grows it: the cache is written outside too
    with torch.inference_mode(False):
        out = old.new_full(shape, fill)
        out.narrow(dim, 0, used).copy_(old)
    return out


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window: WindowSpec | None = None,
        max_rows: int | None = None,
        max_capacity: int | None = None,
    ) -> None:
        """capacity: slots allocated per row. max_capacity: slots a row may grow to (default: capacity,
        allocated once). A draft's cache starts small and grows as its rows do, so that it holds what
        its rows read rather than the draft's whole context for each (a sliding window's never grows
        past its window and the longest block it reads)."""
        self.config = config
        # rows in use: a forward covers rows [0, batch_size). A batched engine allocates max_rows once and
        # adds/removes rows between steps (add_row, remove_row); the live rows stay a prefix
        self.max_rows = max(max_rows or batch_size, batch_size)
        self.batch_size = batch_size
        self.capacity = capacity
        self.max_capacity = max(capacity, max_capacity or capacity)
        self.window = window
        shape = (config.n_layers, self.max_rows, config.n_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views made once: a write is then a single kernel launch
        self._k_layer = list(self.k.unbind(0))
        self._v_layer = list(self.v.unbind(0))
        self._write_idx: torch.Tensor | None = None  # one row: the block's slots
        self._write_at: tuple[torch.Tensor, torch.Tensor] | None = None  # several rows: (row, slot) a token
        # Position of the token held in each slot (-1: empty). Scratch slots get theirs at write time.
        self.slot_pos = torch.full((self.max_rows, capacity), -1, dtype=torch.long, device=device)
        # Host-side bookkeeping: reading these never synchronises with the device.
        self.lengths: list[int] = [0] * batch_size  # committed slots per row
        self.next_pos: list[int] = [0] * batch_size  # position of the next token per row
        self.scratch: int = 0  # scratch slots written this round (the widest row's count)
        self._sealed = False  # a commit ends the round: the next forward starts a new scratch
        self._offset = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    # -- rows (continuous batching) -----------------------------------------------------------------
    def add_row(self) -> int:
        """Start an empty row after the live ones; returns its index."""
        if self.batch_size >= self.max_rows:
            raise SpecstackError(f"KV cache full: all {self.max_rows} rows are in use")
        row = self.batch_size
        self.batch_size += 1
        self.lengths.append(0)
        self.next_pos.append(0)
        self.slot_pos[row] = -1
        return row

    def reserve(self, max_rows: int) -> None:
        """Room for `max_rows` rows (a group of drafters growing one row at a time): the tensors are
        reallocated once, bigger, and the live rows copied over (O(the live rows' slots))."""
        if max_rows <= self.max_rows:
            return
        n = self.batch_size
        grown = {}
        for name in ("k", "v"):
            old = getattr(self, name)
            grown[name] = old.new_zeros((old.shape[0], max_rows, *old.shape[2:]))
            grown[name][:, :n] = old[:, :n]
        self.k, self.v = grown["k"], grown["v"]
        self._k_layer, self._v_layer = list(self.k.unbind(0)), list(self.v.unbind(0))
        slot_pos = self.slot_pos.new_full((max_rows, self.capacity), -1)
        slot_pos[:n] = self.slot_pos[:n]
        self.slot_pos = slot_pos
        self.max_rows = max_rows

    def remove_row(self, row: int) -> int | None:
        """Free a row: the last live row moves into its place (O(that row's tokens), never the whole
        cache), so the live rows stay a prefix. Returns the index of the row that moved (now `row`),
        or None when `row` was the last."""
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row {row} is not live (rows 0..{self.batch_size - 1})")
        last = self.batch_size - 1
        moved = None
        if row != last:
            self._copy_row(last, row)
            moved = last
        self.lengths.pop()
        self.next_pos.pop()
        self.batch_size -= 1
        return moved

    def copy_row(self, src: int) -> int:
        """Add a row after the live ones holding row `src`'s committed tokens; returns its index."""
        row = self.add_row()
        self._copy_row(src, row)
        return row

    def _copy_row(self, src: int, dst: int) -> None:
        """Row dst becomes row src's committed tokens (keys, values, positions): O(its tokens)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.slot_pos[dst] = self.slot_pos[src]
        self.lengths[dst], self.next_pos[dst] = n, self.next_pos[src]

    def load_prefix(self, row: int, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """An empty row starts from the keys/values of positions 0..n-1 given as consecutive pieces
        (k, v) [layers, kv_heads, n_i, head_dim] (a cached prefix's blocks, prefix_cache.py): they become
        its first n = sum n_i committed slots, each piece copied straight into them."""
        n = sum(k.shape[2] for k, _ in pieces)
        if self.lengths[row] or self.next_pos[row]:
            raise ValueError(f"row {row} is not empty: a prefix is loaded before it reads anything")
        if n > self.max_capacity:
            raise SpecstackError(f"KV cache full: a {n}-token prefix, capacity {self.max_capacity}")
        self._grow(n)
        at = 0
        for k, v in pieces:
            m = k.shape[2]
            self.k[:, row, :, at : at + m] = k
            self.v[:, row, :, at : at + m] = v
            at += m
        self.slot_pos[row, :n] = torch.arange(n, device=self.device)
        self.lengths[row] = self.next_pos[row] = n

    def committed_kv(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of a row's committed tokens, [layers, kv_heads, n, head_dim] views, when its
        slots hold positions 0..n-1 in order (None once a sliding window has evicted some)."""
        n = self.lengths[row]
        if self.next_pos[row] != n:
            return None
        return self.k[:, row, :, :n], self.v[:, row, :, :n]

    # -- writing (called by the model, once per layer) -------------------------------------------
    def check_room(self, n_new: int, counts: Sequence[int] | None = None) -> None:
        """Every row has room for its next n_new slots (with counts: row b writes only the first
        n_new - (t - counts[b]) of them, a packed block of rows of different lengths); a growable
        cache grows to give it."""
        if counts is None:
            need = max(self.lengths, default=0) + n_new
        else:
            extra = n_new - max(counts, default=0)
            need = max((n + c + extra for n, c in zip(self.lengths, counts, strict=True)), default=0)
        if need > self.max_capacity:
            raise SpecstackError(
                f"KV cache full: {need} slots needed, capacity {self.max_capacity} "
                "(the prompt plus generated tokens exceed the context limit)"
            )
        self._grow(need)

    def _grow(self, need: int) -> None:
        """At least `need` slots a row (need <= max_capacity): the tensors are reallocated with a quarter
        more than asked, at least twice the old size (amortised O(1) copies a slot), the slots copied."""
        if need <= self.capacity:
            return
        new = min(self.max_capacity, max(need + need // 4, 2 * self.capacity))
        self._widen(new)
        self.capacity = new

    def _widen(self, new: int) -> None:
        """Every per-slot tensor reallocated to `new` slots a row, the old slots copied (a subclass keeping
        more per slot widens it too)."""
        self.k, self.v = widened(self.k, 3, new), widened(self.v, 3, new)
        self._k_layer, self._v_layer = list(self.k.unbind(0)), list(self.v.unbind(0))
        self.slot_pos = widened(self.slot_pos, 1, new, -1)

    def begin_block(self, positions: torch.Tensor, append: bool = False,
                    counts: Sequence[int] | None = None) -> None:
        """Record the positions of the new tokens, written after each row's committed slots (or, with
        `append`, after the scratch already written this round). positions [B, T]: T tokens a row;
        with `counts` (a packed block: rows of different lengths, no padding), positions [1, N] holds
        row 0's counts[0] tokens, then row 1's, ... (N = sum(counts)); a row's scratch is its first
        counts[b] slots of the round."""
        if append and self._sealed:
            raise ValueError("cannot append to scratch after a commit: start a new block")
        if not append:
            self.scratch = 0
            self._sealed = False
        if counts is None:
            b, t = positions.shape
            counts = (t,) * b
        elif len(counts) != self.batch_size or sum(counts) != positions.numel():
            raise ValueError(f"a packed block of {positions.numel()} tokens for row counts {list(counts)}")
        t = max(counts, default=0)
        self.check_room(self.scratch + t, counts)
        self._offset = self.scratch
        self.scratch += t
        if self.batch_size == 1:
            s0 = self.lengths[0] + self._offset
            self._write_idx = torch.arange(s0, s0 + t, device=self.device)
            self._write_at = None
            self.slot_pos[0, s0 : s0 + t] = positions.reshape(-1)
            return
        # (row, slot) of every token, computed once for all layers' writes
        dev = self.device
        rows = torch.repeat_interleave(torch.arange(self.batch_size, device=dev),
                                       torch.tensor(counts, device=dev))
        first = torch.tensor([n + self._offset for n in self.lengths], device=dev)
        row_start = torch.tensor([0, *counts[:-1]], device=dev).cumsum(0)
        slots = first[rows] + torch.arange(rows.shape[0], device=dev) - row_start[rows]
        self._write_at = (rows, slots)
        self._write_idx = None
        self.slot_pos[rows, slots] = positions.reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] (a packed block: [1, Hkv, N, D]) to the scratch slots; return this
        layer's keys/values [B, Hkv, S, D] for the slots a query may see (S = longest row + scratch)."""
        k, v = k.to(self.dtype), v.to(self.dtype)
        if self._write_at is None:
            kl, vl = self._k_layer[layer], self._v_layer[layer]
            if self.max_rows > 1:  # one live row of several: index_copy_ would write every row
                kl, vl = kl[:1], vl[:1]
            kl.index_copy_(2, self._write_idx, k)
            vl.index_copy_(2, self._write_idx, v)
        else:
            rows, slots = self._write_at
            hkv, d = k.shape[1], k.shape[3]
            # advanced indices around a slice put the indexed dims first: [N, Hkv, D]
            self._k_layer[layer][rows, :, slots] = k.transpose(1, 2).reshape(-1, hkv, d)
            self._v_layer[layer][rows, :, slots] = v.transpose(1, 2).reshape(-1, hkv, d)
        s_used = max(self.lengths) + self.scratch
        b = self.batch_size
        return self._k_layer[layer][:b, :, :s_used], self._v_layer[layer][:b, :, :s_used]

    def write_slots(self) -> WriteSlots:
        """Where the current block's keys/values go, for a writer of every layer in one call
        (models/native_decoder.py): what `write` reads, once a forward."""
        rows, slots = self._write_at if self._write_at is not None else (None, None)
        return WriteSlots(self.k, self.v, self._write_idx, rows, slots, self.max_rows > 1,
                          max(self.lengths) + self.scratch)

    def write_layers(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write every layer's k, v [layers, B, Hkv, T, D] to the scratch slots at once (a draft
        replacing its tokens' keys/values by their memories after the pass)."""
        if self._write_at is None:  # one copy per tensor instead of one per layer
            self.k[:, :1].index_copy_(3, self._write_idx, k)
            self.v[:, :1].index_copy_(3, self._write_idx, v)
            return
        for layer in range(k.shape[0]):
            self.write(layer, k[layer], v[layer])

    def _move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst of one row in every per-slot tensor (the read copies: overlap is safe)."""
        self.k[:, row, :, dst] = self.k[:, row, :, src]
        self.v[:, row, :, dst] = self.v[:, row, :, src]
        self.slot_pos[row, dst] = self.slot_pos[row, src]

    # -- committing ---------------------------------------------------------------------------------
    def commit_prefix(self, counts: Sequence[int]) -> None:
        """Keep the first counts[b] tokens of the last block in each row; no data moves."""
        for b, n in enumerate(counts):
            if not 0 <= n <= self.scratch:
                raise ValueError(f"row {b}: cannot commit {n} of a {self.scratch}-token block")
            self.lengths[b] += n
            self.next_pos[b] += n
        self._sealed = True
        self._evict()

    def commit_nodes(self, row: int, node_ids: Sequence[int]) -> None:
        """Keep the tree nodes `node_ids` (block indices of an accepted root-to-leaf path, in order)
        at consecutive slots after the row's committed tokens."""
        n = len(node_ids)
        if n and (min(node_ids) < 0 or max(node_ids) >= self.scratch):
            raise ValueError(f"node ids {list(node_ids)} outside the {self.scratch}-token block")
        s0 = self.lengths[row]
        if list(node_ids) != list(range(n)):
            src = torch.tensor(node_ids, device=self.device) + s0
            self._move(row, src, torch.arange(s0, s0 + n, device=self.device))
        self.lengths[row] += n
        self.next_pos[row] += n
        self._sealed = True
        self._evict()

    def commit_all(self) -> None:
        self.commit_prefix([self.scratch] * self.batch_size)

    def reset(self, row: int | None = None) -> None:
        rows = range(self.batch_size) if row is None else [row]
        for r in rows:
            self.lengths[r] = 0
            self.next_pos[r] = 0
            self.slot_pos[r] = -1

    # -- sliding window -----------------------------------------------------------------------------
    def _evict(self) -> None:
        """Drop slots that no future query can see: all but the first `sink` and the last `window`.
        Done in chunks (only once the row overflows by `window`), so the copy is amortised O(1)."""
        w = self.window
        if w is None:
            return
        keep = w.sink + w.window
        for row, n in enumerate(self.lengths):
            if n < keep + w.window:
                continue
            src = torch.arange(n - w.window, n, device=self.device)
            self._move(row, src, torch.arange(w.sink, keep, device=self.device))
            self.slot_pos[row, keep:] = -1
            self.lengths[row] = keep
