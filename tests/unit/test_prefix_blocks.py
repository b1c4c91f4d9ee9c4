"""The prefix cache's blocks (prefix_cache.py), without a model: what a lookup finds (whole
blocks, then part of the next; a sequence's partial last block too), least-recently-used leaves evicted first under the byte budget, never
the path being stored nor a parent before its children."""
from __future__ import annotations

import pytest
import torch

from specstack.prefix_cache import PrefixCache

B = 4  # tokens a block


def kv(n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of n positions whose value is their position (+ fill): [layers 2, heads 1, n, dim 3]."""
    x = (torch.arange(n, dtype=torch.float32) + fill).reshape(1, 1, n, 1).expand(2, 1, n, 3).contiguous()
    return x, -x


BLOCK_BYTES = 2 * kv(B)[0].nbytes


def test_a_lookup_takes_whole_blocks_then_part_of_the_next():
    cache = PrefixCache(100 * BLOCK_BYTES, block_size=B)
    assert cache.store(list(range(10)), *kv(10)) == 3  # two whole blocks and a partial one (a leaf)
    assert cache.match(list(range(10))).tokens == 10 and cache.tokens == 10
    m = cache.match(list(range(6)) + [99, 98])
    assert m.tokens == 6 and len(m.blocks) == 2  # block 1 whole, block 2's first two tokens
    k, v = m.kv()
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
    assert cache.match([1, 2, 3, 4]).kv()[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
