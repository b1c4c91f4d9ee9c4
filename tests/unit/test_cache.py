"""KVCache: slot writes, commit of a prefix or a tree path (compaction), per-row lengths,
sliding-window eviction, and the full-cache error (DESIGN §2.4, §3).

Most tests drive the cache directly with marker values (K = 1000*layer + marker, V = -K) so every
slot's content can be checked exactly; the window tests also run the tiny models."""
from __future__ import annotations

import pytest
import torch

from specstack.attention import AttentionBatch, build_batch, depths_from_parents, tree_batch
from specstack.cache import KVCache
from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError
from specstack.models.feature_cache import FeatureCache

CFG = ModelConfig(arch="llama", vocab_size=11, d_model=8, n_layers=3, n_heads=2, n_kv_heads=2, d_ff=16,
                  max_seq_len=64)
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def make(batch: int = 1, capacity: int = 32, window: WindowSpec | None = None) -> KVCache:
    return KVCache(CFG, batch, capacity, torch.float32, window=window)


def put(cache: KVCache, markers: list[list[float]], positions: list[list[int]] | None = None) -> None:
    """One 'forward' writing a block whose token (b, t) carries marker markers[b][t] in every layer.
    positions default to each row's next positions."""
    b, t = len(markers), len(markers[0])
    if positions is None:
        positions = [[cache.next_pos[r] + i for i in range(t)] for r in range(b)]
    cache.begin_block(torch.tensor(positions))
    m = torch.tensor(markers, dtype=torch.float32)  # [B, T]
    for layer in range(CFG.n_layers):
        k = (1000.0 * layer + m)[:, None, :, None].expand(b, CFG.n_kv_heads, t, CFG.head_dim)
        keys, values = cache.write(layer, k.contiguous(), -k.contiguous())
        assert keys.shape == (b, CFG.n_kv_heads, max(cache.lengths) + t, CFG.head_dim)
        assert torch.equal(values, -keys)


def markers_at(cache: KVCache, row: int, slots: range | list[int], layer: int = 0) -> list[float]:
    """Markers held by `slots` of a row (checking all heads/dims and V agree)."""
    out = []
    for s in slots:
        k = cache.k[layer, row, :, s]
        assert torch.equal(k, torch.full_like(k, k.flatten()[0].item())), "slot holds mixed data"
        assert torch.equal(cache.v[layer, row, :, s], -k)
        out.append(k.flatten()[0].item() - 1000.0 * layer)
    return out


def committed(cache: KVCache, row: int = 0) -> list[float]:
    return markers_at(cache, row, range(cache.lengths[row]))


# -- commit_prefix -----------------------------------------------------------------------------------
def test_commit_prefix_keeps_first_tokens_without_moving_data():
    cache = make()
    put(cache, [[10, 11, 12, 13, 14]])
    before = cache.k.clone()
    cache.commit_prefix([3])
    assert torch.equal(cache.k, before)
    assert cache.lengths == [3] and cache.next_pos == [3]
    assert committed(cache) == [10, 11, 12]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == [0, 1, 2]
    # the two uncommitted tokens were scratch: the next block overwrites them
    put(cache, [[20, 21]])
    cache.commit_prefix([2])
    assert committed(cache) == [10, 11, 12, 20, 21]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("batch", [1, 2])
def test_write_layers_replaces_every_layers_block_at_once(batch):
    """A draft rewrites its new tokens' keys/values in every layer at once (its memories): the block's
    slots hold the new values in each layer and row, and nothing else changes."""
    cache = make(batch)
    put(cache, [[1, 2, 3]] * batch)
    cache.commit_prefix([3] * batch)
    put(cache, [[10, 11]] * batch)
    before = cache.k.clone()
    m = torch.tensor([[20.0, 21.0]] * batch)
    k = torch.stack([(1000.0 * layer + m)[:, None, :, None].expand(batch, CFG.n_kv_heads, 2, CFG.head_dim)
                     for layer in range(CFG.n_layers)])
    cache.write_layers(k.contiguous(), -k.contiguous())
    for row in range(batch):
        for layer in range(CFG.n_layers):
            assert markers_at(cache, row, range(5), layer) == [1, 2, 3, 20, 21]
    assert torch.equal(cache.k[..., 5:, :], before[..., 5:, :])  # slots after the block untouched
    cache.commit_prefix([2] * batch)
    assert committed(cache, batch - 1) == [1, 2, 3, 20, 21]


def test_commit_prefix_rejects_more_than_the_block():
    cache = make()
    put(cache, [[1, 2]])
    with pytest.raises(ValueError):
        cache.commit_prefix([3])
    with pytest.raises(ValueError):
        cache.commit_prefix([-1])
    assert cache.lengths == [0]


# -- commit_nodes (tree path compaction) -------------------------------------------------------------
@pytest.mark.parametrize("path", [[0, 2, 5, 7], [0, 1, 3, 6], [0, 1], [0], []])
def test_commit_tree_path_compacts_exactly_the_accepted_nodes(path):
    cache = make(batch=2)
    put(cache, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    cache.commit_prefix([5, 5])
    depth = depths_from_parents(PARENTS)
    tree_pos = [[5 + d - 1 for d in depth]] * 2
    tree = [[100.0 + i for i in range(len(PARENTS))], [200.0 + i for i in range(len(PARENTS))]]
    put(cache, tree, tree_pos)
    k_before, v_before, pos_before = cache.k.clone(), cache.v.clone(), cache.slot_pos.clone()

    cache.commit_nodes(0, path)

    n = len(path)
    assert cache.lengths == [5 + n, 5] and cache.next_pos == [5 + n, 5]
    assert committed(cache, 0) == [1, 2, 3, 4, 5] + [100.0 + i for i in path]
    for layer in range(CFG.n_layers):
        assert markers_at(cache, 0, range(5, 5 + n), layer) == [100.0 + i for i in path]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == list(range(5 + n))
    # nothing but the destination slots of row 0 changed (in every layer, K and V)
    changed = (cache.k != k_before).any(dim=(0, 2, 4)) | (cache.v != v_before).any(dim=(0, 2, 4))
    moved = torch.zeros_like(changed)
    moved[0, 5 : 5 + n] = torch.tensor([i != j for j, i in enumerate(path)], dtype=torch.bool)
    assert torch.equal(changed, moved)
    assert torch.equal(cache.slot_pos[1], pos_before[1])

    # the other row keeps its own path later; row 0's commit did not disturb its scratch
    cache.commit_nodes(1, [0, 1, 4])
    assert committed(cache, 1) == [6, 7, 8, 9, 10, 200, 201, 204]
    assert cache.slot_pos[1, : cache.lengths[1]].tolist() == list(range(8))


def test_commit_nodes_rejects_ids_outside_the_block():
    cache = make()
    put(cache, [[1, 2, 3]])
    with pytest.raises(ValueError):
        cache.commit_nodes(0, [0, 3])
    with pytest.raises(ValueError):
        cache.commit_nodes(0, [-1])
    assert cache.lengths == [0]


# -- per-row lengths ---------------------------------------------------------------------------------
def test_rows_have_their_own_lengths():
    cache = make(batch=3)
    put(cache, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    cache.commit_prefix([4, 1, 0])
    assert cache.lengths == [4, 1, 0] and cache.next_pos == [4, 1, 0]
    put(cache, [[20, 21], [30, 31], [40, 41]])
    assert cache.slot_pos[0, 4:6].tolist() == [4, 5]
    assert cache.slot_pos[1, 1:3].tolist() == [1, 2]
    assert cache.slot_pos[2, 0:2].tolist() == [0, 1]
    cache.commit_prefix([2, 1, 2])
    assert committed(cache, 0) == [1, 2, 3, 4, 20, 21]
    assert committed(cache, 1) == [5, 30]
    assert committed(cache, 2) == [40, 41]
    assert [cache.slot_pos[r, : cache.lengths[r]].tolist() for r in range(3)] == [list(range(6)), [0, 1], [0, 1]]
    cache.reset(1)
    assert cache.lengths == [6, 0, 2] and cache.next_pos == [6, 0, 2]


# -- full cache --------------------------------------------------------------------------------------
def test_full_cache_raises_and_leaves_the_cache_intact(tiny):
    model = tiny.lm.model
    cache = model.new_cache(1, capacity=8)
    model.extend(torch.arange(8).view(1, 8), cache)
    with pytest.raises(SpecstackError, match="KV cache full"):
        model.extend(torch.tensor([[1]]), cache)
    assert cache.lengths == [8] and cache.next_pos == [8]
    small = make(capacity=4)
    with pytest.raises(SpecstackError):
        put(small, [[1, 2, 3, 4, 5]])


# -- sliding window ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 3])
def test_window_cache_evicts_physically(block):
    sink, window = 2, 4
    cache = make(capacity=sink + 2 * window + block, window=WindowSpec(sink, window))
    pos = 0
    while pos < 60:
        put(cache, [[float(pos + i) for i in range(block)]])  # marker = position
        cache.commit_prefix([block])
        pos += block
        assert cache.next_pos == [pos]
        assert cache.lengths[0] <= sink + 2 * window  # bounded, however long the sequence grows
        kept = cache.slot_pos[0, : cache.lengths[0]].tolist()
        assert kept == sorted(set(kept)), "positions must stay ordered and unique"
        assert kept[: min(sink, pos)] == list(range(min(sink, pos))), "sink positions are kept"
        recent = list(range(max(0, pos - window), pos))
        assert kept[-len(recent):] == recent, "the last `window` positions are kept"
        assert committed(cache) == [float(p) for p in kept], "K/V moved along with their positions"
    assert cache.lengths[0] < pos  # something was evicted


def _window_mask(n: int, sink: int, window: int) -> torch.Tensor:
    q = torch.arange(n).view(n, 1)
    k = torch.arange(n).view(1, n)
    return (k <= q) & ((k < sink) | (q - k < window))


@pytest.mark.parametrize("sink,window", [(1, 4), (0, 5), (3, 2)])
def test_window_attention_equals_masked_full_attention(tiny, sink, window):
    """A windowed cache (which evicts) gives the same logits as a full cache with the sink+window mask
    built by hand; and the window really changes the result (the test is not vacuous)."""
    model = tiny.lm.model
    n = 30
    g = torch.Generator().manual_seed(sink * 10 + window)
    seq = torch.randint(0, 257, (1, n), generator=g)
    full = model.new_cache(1, capacity=n)
    ref_mask = _window_mask(n, sink, window)
    ref = model.forward(seq, AttentionBatch(torch.arange(n).view(1, n), ref_mask[None, None], (n,)), full).logits[0]
    causal = model.forward(seq, build_batch(model.new_cache(1, capacity=n), n), model.new_cache(1, capacity=n))
    assert (causal.logits[0, -1] - ref[-1]).abs().max() > 1e-2

    blocks = [7, 1, 3, 1, 1, 2, 4, 1, 5, 1, 4]
    assert sum(blocks) == n
    cache = model.new_cache(1, capacity=sink + 2 * window + max(blocks), window=WindowSpec(sink, window))
    done = 0
    for t in blocks:
        out = model.extend(seq[:, done : done + t], cache).logits[0]
        torch.testing.assert_close(out, ref[done : done + t], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, done=done: f"block at {done}: {m}")
        done += t
        assert cache.lengths[0] <= sink + 2 * window + max(blocks)
    assert cache.lengths[0] < n


def test_window_cache_with_ragged_rows(tiny):
    """Two rows advancing by different amounts evict at different times; each row still equals its own
    masked full-attention reference."""
    model = tiny.lm.model
    sink, window, n = 1, 4, 24
    g = torch.Generator().manual_seed(99)
    seqs = torch.randint(0, 257, (2, n), generator=g)
    mask = _window_mask(n, sink, window)
    refs = [
        model.forward(seqs[r : r + 1], AttentionBatch(torch.arange(n).view(1, n), mask[None, None], (n,)),
                      model.new_cache(1, capacity=n)).logits[0]
        for r in range(2)
    ]
    steps = [[5, 2], [1, 4], [3, 1], [1, 1], [4, 3], [2, 5], [1, 2], [3, 1], [4, 5]]
    assert [sum(s[r] for s in steps) for r in range(2)] == [n, n]
    cache = model.new_cache(2, capacity=sink + 2 * window + 2 * 5, window=WindowSpec(sink, window))
    done = [0, 0]
    for step in steps:
        t = max(step)
        tokens = torch.stack([torch.cat([seqs[r, done[r] : done[r] + step[r]],
                                         torch.zeros(t - step[r], dtype=torch.long)]) for r in range(2)])
        out = model.forward(tokens, build_batch(cache, t, n_valid=step), cache).logits
        for r in range(2):
            torch.testing.assert_close(out[r, : step[r]], refs[r][done[r] : done[r] + step[r]], atol=1e-4, rtol=1e-4)
        cache.commit_prefix(step)
        done = [done[r] + step[r] for r in range(2)]
        assert cache.next_pos == done
    assert max(cache.lengths) < n


# -- growing on demand (a draft's cache) ---------------------------------------------------------------
def test_a_growable_cache_keeps_its_slots_as_it_grows():
    """A cache of 2 slots a row that may grow to 40: blocks past its size reallocate it, and every
    committed slot (keys, values, positions, features) and the scratch written this round survive."""
    cache = FeatureCache(CFG, 2, 2, torch.float32, "cpu", None, 3, max_capacity=40)
    put(cache, [[1, 2, 3], [4, 5, 6]])  # 3 slots: grows at once
    assert 3 <= cache.capacity < 40
    cache.feat[:, :3] = torch.arange(18.0).view(2, 3, 3)
    cache.commit_prefix([3, 1])
    for step in range(6):  # rows of different lengths, each block past the last size
        put(cache, [[10.0 * step + i for i in range(5)], [100.0 + step] * 5])
        cache.commit_prefix([5, 2])
    assert cache.lengths == [33, 13] and cache.capacity <= 40
    assert committed(cache, 0) == [1, 2, 3] + [10.0 * s + i for s in range(6) for i in range(5)]
    assert committed(cache, 1) == [4] + [100.0 + s for s in range(6) for _ in range(2)]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == list(range(33))
    assert torch.equal(cache.feat[:, :3], torch.arange(18.0).view(2, 3, 3))
    assert cache.k.shape[3] == cache.slot_pos.shape[1] == cache.feat.shape[1] == cache.capacity
    with pytest.raises(SpecstackError, match="KV cache full"):  # past its limit it is full, as a fixed one
        put(cache, [[1.0] * 8, [1.0] * 8])
    assert cache.lengths == [33, 13]


def test_features_move_with_their_slots():
    """A feature cache's features follow their tokens: a committed tree path, a removed row's move into its
    place, a copied row, the cache growing rows; a plain KVCache keeps none."""
    cache = FeatureCache(CFG, 2, 16, torch.float32, "cpu", None, 2, max_rows=2)
    put(cache, [[1, 2, 3, 4], [5, 6, 7, 8]])
    cache.write_feature(torch.tensor([[[1.0, 1], [2, 2], [3, 3], [4, 4]], [[5, 5], [6, 6], [7, 7], [8, 8]]]))
    cache.commit_nodes(0, [0, 2, 3])  # a path skipping node 1
    cache.commit_nodes(1, [0, 1])
    assert cache.feat[0, :3, 0].tolist() == [1, 3, 4] and committed(cache, 0) == [1, 3, 4]
    cache.reserve(4)  # grown: the live rows keep theirs
    assert cache.copy_row(0) == 2 and cache.feat[2, :3, 0].tolist() == [1, 3, 4]
    assert cache.remove_row(0) == 2  # the last row moved into row 0
    assert cache.feat[0, :3, 0].tolist() == [1, 3, 4] and cache.feat[1, :2, 1].tolist() == [5, 6]
    assert not hasattr(make(), "feat")


def test_a_growable_window_cache_stays_within_its_window():
    """A sliding window's cache grows to its window plus its longest block, never to the sequence."""
    sink, window = 2, 4
    cache = KVCache(CFG, 1, 1, torch.float32, window=WindowSpec(sink, window), max_capacity=1000)
    for pos in range(0, 300, 3):
        put(cache, [[float(pos + i) for i in range(3)]])
        cache.commit_prefix([3])
    assert cache.capacity <= 2 * (sink + 2 * window + 3)
    kept = cache.slot_pos[0, : cache.lengths[0]].tolist()
    assert committed(cache) == [float(p) for p in kept] and kept[-window:] == list(range(300 - window, 300))


def test_a_growing_cache_gives_the_logits_of_a_fixed_one(tiny):
    """A cache that starts at 2 slots and grows: chunks, a tree block whose path is committed and a
    prefix load across its growths give the logits of a cache allocated whole, exactly."""
    model = tiny.lm.model
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 257, (1, 40), generator=g)
    fixed = model.new_cache(1, capacity=64)
    small = KVCache(model.config, 1, 2, fixed.dtype, max_capacity=64)
    for a, b in [(0, 5), (5, 6), (6, 19)]:
        torch.testing.assert_close(model.extend(seq[:, a:b], small).logits, model.extend(seq[:, a:b], fixed).logits,
                                   atol=0, rtol=0)
    parents = [-1, 0, 0, 1, 2]
    tree = seq[:, 19:24]
    outs = []
    for cache in (small, fixed):
        batch = tree_batch(cache, parents)
        outs.append(model.forward(tree, batch, cache).logits)
        cache.commit_nodes(0, [0, 2])
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    rest = seq[:, 24:]
    torch.testing.assert_close(model.extend(rest, small).logits, model.extend(rest, fixed).logits, atol=0, rtol=0)
    assert small.capacity < 64  # it grew only as far as it needed
    other = KVCache(model.config, 1, 1, fixed.dtype, max_capacity=64)
    other.load_prefix(0, [fixed.committed_kv(0)])  # a cached prefix longer than it holds
    torch.testing.assert_close(model.extend(seq[:, :3], other).logits, model.extend(seq[:, :3], fixed).logits,
                               atol=0, rtol=0)
