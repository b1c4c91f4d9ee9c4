"""Preallocated KV cache written by slot (gpt-fast style), with per-row lengths and tree commit.

Layout: one tensor per K and V of shape [layers, rows, kv_heads, capacity, head_dim], so a commit
moves the accepted nodes of every layer in one indexed copy.

Each row has `length` committed slots; a forward writes its T new keys/values into the scratch slots
[length, length + T) and nothing becomes visible to later forwards until the caller commits:
- `commit_prefix(counts)`: keep the first counts[b] new tokens of each row (prefill, decode, chains);
  no copy at all.
- `commit_nodes(row, node_ids)`: keep an accepted root-to-leaf path of a tree; the accepted nodes are
  compacted to consecutive slots (O(accepted) copies, never the whole cache), the rest is dead.
- `rollback(row, n)`: forget the last n committed tokens (O(1)).
A forward may also *append* to the scratch of earlier forwards of the same round (a draft model
growing a chain or tree token by token before anything is verified); node ids in `commit_nodes`
then count over the whole scratch.

Keys are stored after RoPE, so a slot carries its position in `slot_pos`; that is what lets the
sliding-window mode evict old slots physically (first `sink` positions plus the last `window`) while
the mask builder in attention.py still reasons in positions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window: WindowSpec | None = None,
        feature_dim: int = 0,
    ) -> None:
        self.config = config
        self.batch_size = batch_size
        self.capacity = capacity
        self.window = window
        shape = (config.n_layers, batch_size, config.n_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views made once: a write is then a single kernel launch
        self._k_layer = list(self.k.unbind(0))
        self._v_layer = list(self.v.unbind(0))
        # optional per-slot feature vector [rows, capacity, feature_dim] that moves with its slot (a draft
        # reading the previous token's top-level feature, EAGLE-style)
        self.feat = torch.zeros(batch_size, capacity, feature_dim, dtype=dtype, device=device) if feature_dim else None
        self._write_idx: torch.Tensor | None = None
        # Position of the token held in each slot (-1: empty). Scratch slots get theirs at write time.
        self.slot_pos = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        # Host-side bookkeeping: reading these never synchronises with the device.
        self.lengths: list[int] = [0] * batch_size  # committed slots per row
        self.next_pos: list[int] = [0] * batch_size  # position of the next token per row
        self.scratch: int = 0  # scratch slots written this round (same count in every row)
        self._sealed = False  # a commit ends the round: the next forward starts a new scratch
        self._offset = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    # -- writing (called by the model, once per layer) -------------------------------------------
    def check_room(self, n_new: int) -> None:
        need = max(self.lengths) + n_new
        if need > self.capacity:
            raise SpecstackError(
                f"KV cache full: {need} slots needed, capacity {self.capacity} "
                "(the prompt plus generated tokens exceed the context limit)"
            )

    def begin_block(self, positions: torch.Tensor, append: bool = False) -> None:
        """Record the positions of the T new tokens, written after each row's committed slots
        (or, with `append`, after the scratch already written this round)."""
        b, t = positions.shape
        if append and self._sealed:
            raise ValueError("cannot append to scratch after a commit: start a new block")
        if not append:
            self.scratch = 0
            self._sealed = False
        self.check_room(self.scratch + t)
        self._offset = self.scratch
        self.scratch += t
        if b == 1:
            s0 = self.lengths[0] + self._offset
            self._write_idx = torch.arange(s0, s0 + t, device=self.device)
            self.slot_pos[0, s0 : s0 + t] = positions[0]
        else:
            self.slot_pos.scatter_(1, self._scratch_slots(t), positions)

    def _scratch_slots(self, t: int) -> torch.Tensor:
        start = torch.tensor(self.lengths, device=self.device).unsqueeze(1) + self._offset
        return start + torch.arange(t, device=self.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] to the scratch slots; return this layer's keys/values [B, Hkv, S, D]
        for the slots a query may see (S = longest row + T)."""
        t = k.shape[2]
        if self.batch_size == 1:
            self._k_layer[layer].index_copy_(2, self._write_idx, k)
            self._v_layer[layer].index_copy_(2, self._write_idx, v)
            s_used = self.lengths[0] + self.scratch
        else:
            slots = self._scratch_slots(t)  # [B, T]
            rows = torch.arange(self.batch_size, device=self.device).unsqueeze(1).expand_as(slots)
            # advanced indices around a slice put the indexed dims first: [B, T, Hkv, D]
            self.k[layer][rows, :, slots] = k.transpose(1, 2)
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
            s_used = max(self.lengths) + self.scratch
        return self._k_layer[layer][:, :, :s_used], self._v_layer[layer][:, :, :s_used]

    def write_layers(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write every layer's k, v [layers, B, Hkv, T, D] to the scratch slots at once (a draft
        replacing its tokens' keys/values by their memories after the pass)."""
        if self.batch_size == 1:  # one copy per tensor instead of one per layer
            self.k.index_copy_(3, self._write_idx, k)
            self.v.index_copy_(3, self._write_idx, v)
            return
        for layer in range(k.shape[0]):
            self.write(layer, k[layer], v[layer])

    def write_feature(self, x: torch.Tensor) -> None:
        """Store features x [B, T, feature_dim] at the current block's scratch slots."""
        if self.batch_size == 1:
            self.feat[0].index_copy_(0, self._write_idx, x[0])
        else:
            slots = self._scratch_slots(x.shape[1])
            rows = torch.arange(self.batch_size, device=self.device).unsqueeze(1).expand_as(slots)
            self.feat[rows, slots] = x

    def block_start(self) -> list[int]:
        """First slot of the current block in each row (slots before it hold finished tokens)."""
        return [n + self._offset for n in self.lengths]

    def _move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst of one row in every per-slot tensor (the read copies: overlap is safe)."""
        self.k[:, row, :, dst] = self.k[:, row, :, src]
        self.v[:, row, :, dst] = self.v[:, row, :, src]
        self.slot_pos[row, dst] = self.slot_pos[row, src]
        if self.feat is not None:
            self.feat[row, dst] = self.feat[row, src]

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

    def rollback(self, row: int, n: int) -> None:
        """Forget the last n committed tokens of a row (O(1): the slots become scratch again)."""
        if not 0 <= n <= self.lengths[row]:
            raise ValueError(f"row {row}: cannot roll back {n} of {self.lengths[row]} tokens")
        if self.window is not None and self.next_pos[row] != self.lengths[row]:
            raise ValueError("cannot roll back past an eviction of a sliding-window cache")
        self.lengths[row] -= n
        self.next_pos[row] -= n

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

    def committed_positions(self, row: int) -> list[int]:
        return self.slot_pos[row, : self.lengths[row]].tolist()
