"""The prefix cache's blocks (prefix_cache.py), without a model: what a lookup finds (whole
blocks, then part of the next; a sequence's partial last block too), least-recently-used leaves evicted
first when the pool is full, never the path being stored nor a parent before its children; the pool's
accounting under random store / match / evict sequences."""
from __future__ import annotations

import random

import pytest
import torch

from specstack.prefix_cache import POOL_CHUNKS, Match, PrefixCache

B = 4  # tokens a block


def kv(n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of n positions whose value is their position (+ fill): [layers 2, heads 1, n, dim 3]."""
    x = (torch.arange(n, dtype=torch.float32) + fill).reshape(1, 1, n, 1).expand(2, 1, n, 3).contiguous()
    return x, -x


BLOCK_BYTES = 2 * kv(B)[0].nbytes


def keys(m: Match) -> tuple[torch.Tensor, torch.Tensor]:
    """A match's keys and values as one tensor each (its pieces in order)."""
    pieces = m.pieces()
    return torch.cat([k for k, _ in pieces], 2), torch.cat([v for _, v in pieces], 2)


def test_a_lookup_takes_whole_blocks_then_part_of_the_next():
    cache = PrefixCache(100 * BLOCK_BYTES, block_size=B)
    assert cache.store(list(range(10)), *kv(10)) == 3  # two whole blocks and a partial one (a leaf)
    assert cache.match(list(range(10))).tokens == 10 and cache.tokens == 10
    m = cache.match(list(range(6)) + [99, 98])
    assert m.tokens == 6 and len(m.blocks) == 2  # block 1 whole, block 2's first two tokens
    k, v = keys(m)
    assert k.shape == (2, 1, 6, 3) and k[0, 0, :, 0].tolist() == list(range(6)) and torch.equal(v, -k)
    assert cache.match(list(range(10)), limit=5).tokens == 5  # a row keeps its last prompt token to read
    assert cache.match([7, 1, 2, 3]).tokens == 0 and cache.match([]).tokens == 0
    assert cache.store(list(range(8)), *kv(8)) == 0  # already there: nothing copied


def test_the_stats_count_what_rows_took():
    cache = PrefixCache(100 * BLOCK_BYTES, block_size=B)
    cache.store(list(range(8)), *kv(8))
    cache.use(cache.match(list(range(8)), limit=7))
    cache.use(cache.match([5, 5, 5]))
    st = cache.stats
    assert (st.queries, st.hits, st.cached_tokens, st.stored_blocks) == (2, 1, 7, 2)


def test_the_least_recently_used_leaf_goes_first_and_parents_after_their_children():
    cache = PrefixCache(3 * BLOCK_BYTES, block_size=B)
    a = [1, 1, 1, 1, 2, 2, 2, 2]  # blocks a1 -> a2
    b = [3, 3, 3, 3]
    cache.store(a, *kv(8))
    cache.store(b, *kv(4, 100.0))
    cache.use(cache.match(a[:4]))  # a1 used after b (a2 is not)
    cache.store([4, 4, 4, 4], *kv(4))  # full: the oldest leaf, a2, goes (a1 is newer but a parent)
    assert cache.match(a).tokens == 4 and cache.match(b).tokens == 4
    cache.store([5, 5, 5, 5], *kv(4))  # next oldest leaf: b (a1 was used later)
    assert cache.match(b).tokens == 0 and cache.match(a).tokens == 4
    assert cache.nbytes == 3 * BLOCK_BYTES and cache.stats.evicted_blocks == 2


def test_a_path_being_stored_is_never_evicted_for_its_own_blocks():
    cache = PrefixCache(2 * BLOCK_BYTES, block_size=B)
    assert cache.store(list(range(12)), *kv(12)) == 2  # the third block would need a block of its own path
    assert cache.match(list(range(12))).tokens == 8 and cache.stats.evicted_blocks == 0


@pytest.mark.parametrize("budget", [0, BLOCK_BYTES - 1])
def test_a_budget_below_one_block_keeps_nothing(budget):
    cache = PrefixCache(budget, block_size=B)
    assert cache.store(list(range(8)), *kv(8)) == 0 and cache.nbytes == 0


def test_blocks_are_copies_not_views_of_the_rows_cache():
    cache = PrefixCache(10 * BLOCK_BYTES, block_size=B)
    k, v = kv(4)
    cache.store([1, 2, 3, 4], k, v)
    k.zero_()  # the row's slots are reused by the next request
    assert keys(cache.match([1, 2, 3, 4]))[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_partial_block_holds_a_whole_slot_and_the_bytes_are_slots_in_use():
    cache = PrefixCache(10 * BLOCK_BYTES, block_size=B)
    cache.store(list(range(6)), *kv(6))  # one whole block and a partial one
    assert cache.nbytes == 2 * BLOCK_BYTES and cache.tokens == 6
    assert cache.pool is not None and cache.pool.capacity == 10


def test_the_pool_grows_in_chunks_up_to_the_budget_and_keeps_them():
    cache = PrefixCache(4 * POOL_CHUNKS * BLOCK_BYTES + BLOCK_BYTES - 1, block_size=B)  # 4 slots a chunk
    cache.store([1] * B, *kv(B))
    assert cache.allocated_bytes == 4 * BLOCK_BYTES  # the first chunk only
    for i in range(4 * POOL_CHUNKS + 5):
        cache.store([i + 10] * B, *kv(B))
    assert cache.allocated_bytes == 4 * POOL_CHUNKS * BLOCK_BYTES == cache.nbytes  # full, never above
    assert cache.pool is not None and len(cache.pool.k) == POOL_CHUNKS
    cache.clear()
    assert cache.nbytes == 0 and cache.allocated_bytes == 4 * POOL_CHUNKS * BLOCK_BYTES  # kept for what comes


def test_one_cache_refuses_keys_of_another_shape():
    cache = PrefixCache(10 * BLOCK_BYTES, block_size=B)
    cache.store([1] * B, *kv(B))
    with pytest.raises(ValueError, match="one prefix cache serves one model"):
        cache.store([2] * B, torch.zeros(3, 1, B, 3), torch.zeros(3, 1, B, 3))


def _reachable(cache: PrefixCache) -> set:
    seen, todo = set(), list(cache.roots.values())
    while todo:
        b = todo.pop()
        seen.add(b)
        todo.extend(b.children.values())
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_the_pool_accounting_holds_under_random_store_match_evict(seed):
    """Random prompts over a small alphabet (so they share prefixes and diverge inside blocks), stored,
    matched and used under a budget of a few blocks: after every operation the bytes are blocks × slot
    bytes, never above the budget; every kept block is reachable from a root, holds a slot of its own,
    and its keys are those of its positions in the sequence that stored it (no slot reused under a
    live block); the free slots and the live ones partition what is allocated."""
    rng = random.Random(seed)
    slots = rng.randint(2, 12)
    budget = slots * BLOCK_BYTES + rng.randint(0, BLOCK_BYTES - 1)
    cache = PrefixCache(budget, block_size=B)
    for _ in range(300):
        prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 6 * B))]
        if rng.random() < 0.6:
            cache.store(prompt, *prefix_kv(prompt))
        else:
            cache.use(cache.match(prompt, limit=len(prompt) - 1))
        m = cache.match(prompt)
        if m.tokens:  # keys are a function of the prefix, as a model's are: a match reads those of its own
            assert torch.equal(keys(m)[0], prefix_kv(prompt)[0][:, :, : m.tokens])
        pool = cache.pool
        if pool is None:
            continue
        assert cache.nbytes == len(cache.blocks) * pool.block_bytes <= budget
        assert pool.allocated <= pool.capacity == slots
        assert _reachable(cache) == cache.blocks
        live = [b.slot for b in cache.blocks]
        assert len(set(live)) == len(live) and not set(live) & set(pool.free)
        assert sorted(live + pool.free) == list(range(pool.allocated))
        assert cache.tokens == sum(len(b.tokens) for b in cache.blocks)


def prefix_kv(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values whose position i is a function of prompt[: i + 1] (as a model's are)."""
    x = torch.tensor([float(hash(tuple(prompt[: i + 1])) % 100_003) for i in range(len(prompt))])
    x = x.reshape(1, 1, -1, 1).expand(2, 1, len(prompt), 3).contiguous()
    return x, -x
