"""Prefix cache: keys and values of prompts already read, kept by token prefix, so a request that starts
the same way reads only what is new (vLLM's automatic prefix caching, SGLang's RadixAttention).

Which: a tree of fixed-size blocks (vLLM's blocks, chained as SGLang's radix tree is). A block holds
`block_size` tokens and their keys/values at positions [start, start + block_size) (a sequence's last
block may hold fewer: a leaf, so that a prompt sent again finds all of it); it is found from its
parent block by its own tokens (a dict keyed by the token tuple: exact, no hash collisions to guard
against), so a lookup walks the prompt block by block in O(prompt) and the chain of blocks IS the
prefix. Why blocks and not a radix tree with edges of any length: an edge of any length has to be split
when a later prompt diverges inside it, which here would mean slicing and re-storing key/value tensors;
fixed blocks never split. The token-granular reuse a radix tree gives is kept by matching the first
block that differs *partially*: the longest common run of its tokens is reused (its first m slots), so
a prompt that diverges inside a block still reuses every token before the divergence.

Why copies: the engine's KV cache is one contiguous region per row (cache.py, gpt-fast style), not a
paged pool, so rows cannot point at shared blocks; a row that starts from a cached prefix gets it copied
into its slots once (O(prefix) memory traffic, far below the forward it replaces), and after that
needs nothing from this cache. So eviction can never take what a running row needs: no running row
reads a block. Rows of one prompt (n samples, a retried request) read it once: the engine holds the
younger rows back while the oldest reads it (engine/batched.py), then copies it into each.

Memory: one block pool (vLLM's BlockPool, llama.cpp's fixed KV buffer): the keys and values of every
block live in slots of a few large tensors `[slots, layers, kv_heads, block_size, head_dim]`, allocated
when the first block is stored, in up to POOL_CHUNKS chunks as the cache fills, never beyond the budget
and never freed; a block takes a free slot by index and gives it back when evicted. So nothing is
allocated per block (a server that evicts all day does not fragment the allocator's heap), and the
cache's bytes are exactly its slots in use × a slot's bytes (a partial last block costs a whole slot).

Eviction: least recently used *leaf* first (a block whose prefix nobody extends), when no slot is free;
an interior block goes only after its children, so every block kept stays reachable.
Only blocks whose positions equal their slots are stored (a sliding-window cache evicts slots: none).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_SIZE = 32  # tokens a block holds: smaller reuses more of a diverging block, costs more lookups
POOL_CHUNKS = 8  # the pool grows in at most this many allocations: a small cache's first use stays small


class BlockPool:
    """Slots for blocks' keys and values: `capacity` of them (what the budget holds), allocated in chunks
    of `chunk` slots as they are first needed, then handed out and returned by index (a free list)."""

    def __init__(self, max_bytes: int, like: torch.Tensor, block_size: int) -> None:
        layers, heads, _, dim = like.shape
        self.shape = (layers, heads, block_size, dim)  # one block's keys (or values)
        self.dtype, self.device = like.dtype, like.device
        self.block_bytes = 2 * math.prod(self.shape) * like.element_size()  # keys and values
        self.capacity = max_bytes // self.block_bytes
        self.chunk = max(1, math.ceil(self.capacity / POOL_CHUNKS))
        self.k: list[torch.Tensor] = []  # chunk c holds slots c * chunk .. (c + 1) * chunk - 1
        self.v: list[torch.Tensor] = []
        self.free: list[int] = []
        self.allocated = 0  # slots with memory behind them

    def fits(self, k: torch.Tensor) -> bool:
        """Keys [layers, kv_heads, n, head_dim] of this pool's shape and dtype."""
        return (k.shape[:2], k.shape[3], k.dtype, k.device) == (self.shape[:2], self.shape[3], self.dtype, self.device)

    @property
    def used(self) -> int:
        return self.allocated - len(self.free)

    def take(self) -> int | None:
        """A free slot, allocating the next chunk if none is free and the budget allows; None when full."""
        if not self.free and self.allocated < self.capacity:
            n = min(self.chunk, self.capacity - self.allocated)
            self.k.append(torch.empty((n, *self.shape), dtype=self.dtype, device=self.device))
            self.v.append(torch.empty((n, *self.shape), dtype=self.dtype, device=self.device))
            self.free.extend(range(self.allocated + n - 1, self.allocated - 1, -1))  # lowest slot first
            self.allocated += n
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def views(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot's keys and values of its first n positions: [layers, kv_heads, n, head_dim] views."""
        c, i = divmod(slot, self.chunk)
        return self.k[c][i, :, :, :n], self.v[c][i, :, :, :n]


@dataclass(eq=False)
class Block:
    tokens: tuple[int, ...]
    pool: BlockPool
    slot: int  # where its keys and values are in the pool
    parent: Block | None
    depth: int  # blocks before it: it holds positions [depth * block_size, (depth + 1) * block_size)
    used: int = 0  # the cache's clock when it was last matched or stored
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)

    def kv(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of its first n tokens (all by default): [layers, kv_heads, n, head_dim] views."""
        return self.pool.views(self.slot, len(self.tokens) if n is None else n)


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a prompt: its blocks in order and how many tokens of the last to use."""

    blocks: tuple[Block, ...] = ()
    tokens: int = 0  # tokens of the prefix (every block whole but the last, of which the first `tokens - ...`)

    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of the prefix's positions 0 .. tokens - 1, block by block: views of the pool,
        which a row's cache copies one after the other (no concatenated copy in between)."""
        if not self.blocks:
            return []
        cut = self.tokens - sum(len(b.tokens) for b in self.blocks[:-1])
        return [b.kv() for b in self.blocks[:-1]] + [self.blocks[-1].kv(cut)]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # rows that looked for a prefix
    hits: int = 0  # ... and found at least one token
    cached_tokens: int = 0  # prompt tokens taken from the cache instead of read
    stored_blocks: int = 0  # blocks ever stored
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"a block holds at least one token, got {block_size}")
        self.max_bytes, self.block_size = max_bytes, block_size
        self.roots: dict[tuple[int, ...], Block] = {}  # the first block of every cached prefix
        self.blocks: set[Block] = set()
        self.pool: BlockPool | None = None  # made at the first store, when the keys' shape is known
        self.tokens = 0  # tokens whose keys/values the blocks hold
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)

    @property
    def nbytes(self) -> int:
        """Bytes of the slots its blocks hold (a partial block holds a whole slot)."""
        return 0 if self.pool is None else self.pool.used * self.pool.block_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool's chunks allocated so far: at most the budget, never given back."""
        return 0 if self.pool is None else self.pool.allocated * self.pool.block_bytes

    def _children(self, parent: Block | None) -> dict[tuple[int, ...], Block]:
        return self.roots if parent is None else parent.children

    # -- reading --------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest cached prefix of `tokens`, at most `limit` tokens (a row keeps its last prompt
        token to read itself: its logits give the first new token). Pure: neither stats nor recency move."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        b = self.block_size
        blocks: list[Block] = []
        parent: Block | None = None
        at = 0
        while at + b <= limit:
            child = self._children(parent).get(tuple(tokens[at : at + b]))
            if child is None:
                break
            blocks.append(child)
            parent, at = child, at + b
        # the next block may match partially: the child sharing the longest run of the remaining tokens
        rest = tokens[at : min(limit, at + b)]
        best, best_n = None, 0
        if rest:
            for child in self._children(parent).values():
                n = common_prefix(child.tokens, rest)
                if n > best_n:
                    best, best_n = child, n
        if best is not None:
            blocks.append(best)
        return Match(tuple(blocks), at + best_n)

    def use(self, match: Match) -> None:
        """A row took `match`: count it, and make its blocks the most recently used (root first, so a
        leaf is never older than its parent)."""
        self.stats.queries += 1
        if match.tokens:
            self.stats.hits += 1
            self.stats.cached_tokens += match.tokens
        for block in match.blocks:
            block.used = next(self._clock)

    # -- writing --------------------------------------------------------------------------------------
    def store(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> int:
        """Keep the blocks of `tokens` whose keys/values k, v [layers, kv_heads, >= len(tokens), head_dim]
        hold at positions 0..len(tokens) - 1 (a row's committed slots), the last one partial if they end
        inside a block: the blocks already cached are only touched, the new ones copied into free slots
        (the least recently used leaves evicted for them). Returns the blocks copied."""
        if self.pool is None:
            self.pool = BlockPool(self.max_bytes, k, self.block_size)
        elif not self.pool.fits(k):
            raise ValueError(f"keys {tuple(k.shape)} {k.dtype} do not fit this cache's blocks "
                             f"{self.pool.shape} {self.pool.dtype}: one prefix cache serves one model")
        b = self.block_size
        parent: Block | None = None
        path: list[Block] = []
        new = 0
        for at in range(0, len(tokens), b):
            key = tuple(tokens[at : at + b])
            block = self._children(parent).get(key)
            if block is None:
                slot = self._free_slot(keep=set(path))
                if slot is None:
                    break
                block = Block(key, self.pool, slot, parent, at // b)
                bk, bv = block.kv()
                bk.copy_(k[:, :, at : at + len(key)])
                bv.copy_(v[:, :, at : at + len(key)])
                self._children(parent)[key] = block
                self.blocks.add(block)
                self.tokens += len(key)
                self.stats.stored_blocks += 1
                new += 1
            block.used = next(self._clock)
            path.append(block)
            parent = block
        return new

    def _free_slot(self, keep: set[Block]) -> int | None:
        """A slot for one more block: a free one, else the least recently used leaf's (never one of
        `keep`: the path being stored); None if every block is on that path."""
        assert self.pool is not None
        slot = self.pool.take()
        if slot is not None:
            return slot
        leaves = (blk for blk in self.blocks if not blk.children and blk not in keep)
        oldest = min(leaves, key=lambda x: x.used, default=None)
        if oldest is None:
            return None
        self._evict(oldest)
        return self.pool.take()

    def _evict(self, block: Block) -> None:
        del self._children(block.parent)[block.tokens]
        self.blocks.discard(block)
        block.pool.give(block.slot)
        self.tokens -= len(block.tokens)
        self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Every block evicted (children first); the pool's memory stays, for the blocks to come."""
        for block in sorted(self.blocks, key=lambda x: -x.depth):
            self._evict(block)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
