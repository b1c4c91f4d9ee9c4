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

Eviction: least recently used *leaf* first (a block whose prefix nobody extends), under a byte budget;
an interior block goes only after its children, so every block kept stays reachable.
Only blocks whose positions equal their slots are stored (a sliding-window cache evicts slots: none).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_SIZE = 32  # tokens a block holds: smaller reuses more of a diverging block, costs more lookups


@dataclass(eq=False)
class Block:
    tokens: tuple[int, ...]
    k: torch.Tensor  # [layers, kv_heads, block_size, head_dim]
    v: torch.Tensor
    parent: Block | None
    depth: int  # blocks before it: it holds positions [depth * block_size, (depth + 1) * block_size)
    used: int = 0  # the cache's clock when it was last matched or stored
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a prompt: its blocks in order and how many tokens of the last to use."""

    blocks: tuple[Block, ...] = ()
    tokens: int = 0  # tokens of the prefix (every block whole but the last, of which the first `tokens - ...`)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the prefix's positions 0 .. tokens - 1: [layers, kv_heads, tokens, head_dim]."""
        ks = [b.k for b in self.blocks]
        vs = [b.v for b in self.blocks]
        cut = self.tokens - sum(len(b.tokens) for b in self.blocks[:-1])
        ks[-1], vs[-1] = ks[-1][:, :, :cut], vs[-1][:, :, :cut]
        return torch.cat(ks, 2), torch.cat(vs, 2)


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
        self.nbytes = 0
        self.tokens = 0  # tokens whose keys/values the blocks hold
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)

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
        inside a block: the blocks already cached are only touched, the new ones copied. Returns the
        blocks copied."""
        b = self.block_size
        parent: Block | None = None
        path: list[Block] = []
        new = 0
        for at in range(0, len(tokens), b):
            key = tuple(tokens[at : at + b])
            block = self._children(parent).get(key)
            if block is None:
                n = len(key)
                size = 2 * k[:, :, :n].nbytes
                if size > self.max_bytes or not self._make_room(size, keep=set(path)):
                    break
                block = Block(key, k[:, :, at : at + n].clone(), v[:, :, at : at + n].clone(), parent, at // b)
                self._children(parent)[key] = block
                self.blocks.add(block)
                self.nbytes += block.nbytes
                self.tokens += n
                self.stats.stored_blocks += 1
                new += 1
            block.used = next(self._clock)
            path.append(block)
            parent = block
        return new

    def _make_room(self, size: int, keep: set[Block]) -> bool:
        """Evict least recently used leaves (never one of `keep`: the path being stored) until `size` more
        bytes fit; False if they cannot."""
        if self.nbytes + size <= self.max_bytes:
            return True
        leaves = sorted((blk for blk in self.blocks if not blk.children and blk not in keep), key=lambda x: x.used)
        while leaves and self.nbytes + size > self.max_bytes:
            block = leaves.pop(0)
            self._evict(block)
            parent = block.parent
            if parent is not None and not parent.children and parent not in keep:  # its parent is a leaf now
                i = next((j for j, x in enumerate(leaves) if x.used > parent.used), len(leaves))
                leaves.insert(i, parent)
        return self.nbytes + size <= self.max_bytes

    def _evict(self, block: Block) -> None:
        del self._children(block.parent)[block.tokens]
        self.blocks.discard(block)
        self.nbytes -= block.nbytes
        self.tokens -= len(block.tokens)
        self.stats.evicted_blocks += 1

    def clear(self) -> None:
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
