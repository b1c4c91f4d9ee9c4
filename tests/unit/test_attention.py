"""The one mask builder (DESIGN §2.3): ancestor masks and depths of draft trees, and build_batch's masks
for causal blocks over a cache, ragged padding, stale scratch slots, trees and sliding windows; the
block masks of a tree grown in a drafter's scratch, the window rule alone, and the masks of a SPIRe
draft's unrolled training forward. Every expected mask here is written out by hand."""
from __future__ import annotations

import pytest
import torch

from specstack.attention import (
    ancestor_mask,
    build_batch,
    causal_block_mask,
    depths_from_parents,
    scratch_tree_mask,
    tree_batch,
    unrolled_step_mask,
    window_mask,
)
from specstack.cache import KVCache
from specstack.config import ModelConfig, WindowSpec

CFG = ModelConfig(arch="llama", vocab_size=11, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16,
                  max_seq_len=64)
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def B(rows: list[str]) -> torch.Tensor:
    """'1 0 1' rows -> bool tensor."""
    return torch.tensor([[c == "1" for c in r.split()] for r in rows])


def cache_with(lengths: list[int], window: WindowSpec | None = None, block: int | None = None) -> KVCache:
    """A cache whose rows hold `lengths` committed tokens (committed from one block per row)."""
    cache = KVCache(CFG, len(lengths), 32, torch.float32, window=window)
    t = block or max(max(lengths), 1)
    cache.begin_block(torch.arange(t).expand(len(lengths), t))
    cache.commit_prefix(lengths)
    return cache


def test_ancestor_mask_of_a_branching_tree():
    expected = B([
        "1 0 0 0 0 0 0 0",
        "1 1 0 0 0 0 0 0",
        "1 0 1 0 0 0 0 0",
        "1 1 0 1 0 0 0 0",
        "1 1 0 0 1 0 0 0",
        "1 0 1 0 0 1 0 0",
        "1 1 0 1 0 0 1 0",
        "1 0 1 0 0 1 0 1",
    ])
    assert torch.equal(ancestor_mask(PARENTS), expected)
    assert depths_from_parents(PARENTS) == [1, 2, 2, 3, 3, 3, 4, 4]


def test_ancestor_mask_of_a_chain_is_causal_and_of_a_forest_separates_roots():
    assert torch.equal(ancestor_mask([-1, 0, 1, 2]), causal_block_mask(4))
    assert depths_from_parents([-1, 0, 1, 2]) == [1, 2, 3, 4]
    forest = [-1, -1, 0, 1, 2]
    assert torch.equal(ancestor_mask(forest), B([
        "1 0 0 0 0",
        "0 1 0 0 0",
        "1 0 1 0 0",
        "0 1 0 1 0",
        "1 0 1 0 1",
    ]))
    assert depths_from_parents(forest) == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0]])
def test_ancestor_mask_rejects_parents_after_children(parents):
    with pytest.raises(ValueError):
        ancestor_mask(parents)


def test_empty_cache_causal_block_uses_the_plain_causal_path():
    cache = cache_with([0])
    batch = build_batch(cache, 4)
    assert batch.mask is None  # SDPA's is_causal path: a full causal triangle over the block
    assert batch.positions.tolist() == [[0, 1, 2, 3]]
    assert batch.n_valid == (4,) and batch.num_tokens == 4


def test_causal_block_after_committed_tokens():
    cache = cache_with([3])
    batch = build_batch(cache, 3)
    assert batch.positions.tolist() == [[3, 4, 5]]
    assert batch.mask.shape == (1, 1, 3, 6)
    assert torch.equal(batch.mask[0, 0], B([
        "1 1 1 1 0 0",
        "1 1 1 1 1 0",
        "1 1 1 1 1 1",
    ]))


def test_ragged_rows_with_padding():
    cache = cache_with([3, 1])
    batch = build_batch(cache, 2, n_valid=[2, 1])
    assert batch.positions.tolist() == [[3, 4], [1, 1]]  # padding takes the row's next position
    assert batch.mask.shape == (2, 1, 2, 5)
    assert torch.equal(batch.mask[0, 0], B([
        "1 1 1 1 0",
        "1 1 1 1 1",
    ]))
    row1 = batch.mask[1, 0]
    # the real token of row 1 sees its committed slot and itself; not its padding, not slots past its block
    assert torch.equal(row1[0], B(["1 1 0 0 0"])[0])
    # a padding query must see at least itself (a fully masked row would give NaN), nothing past the block
    assert row1[1, 2] and not row1[1, 3:].any()


def test_stale_scratch_slots_are_never_visible():
    # row 0 wrote a 4-token block but kept only 1 token: slots 1..3 hold dead keys
    cache = cache_with([1, 4], block=4)
    batch = build_batch(cache, 1)
    assert batch.positions.tolist() == [[1], [4]]
    assert torch.equal(batch.mask[:, 0, 0], B([
        "1 1 0 0 0",
        "1 1 1 1 1",
    ]))


def test_tree_batch_mask_and_positions():
    cache = cache_with([2])
    batch = tree_batch(cache, PARENTS)
    assert batch.positions.tolist() == [[2, 3, 3, 4, 4, 4, 5, 5]]
    mask = batch.mask[0, 0]
    assert mask.shape == (8, 10)
    assert mask[:, :2].all()
    assert torch.equal(mask[:, 2:], ancestor_mask(PARENTS))


def test_tree_batch_in_rows_of_different_lengths():
    cache = cache_with([2, 5])
    batch = tree_batch(cache, [-1, 0, 0])
    assert batch.positions.tolist() == [[2, 3, 3], [5, 6, 6]]
    assert torch.equal(batch.mask[0, 0], B([
        "1 1 1 0 0 0 0 0",
        "1 1 1 1 0 0 0 0",
        "1 1 1 0 1 0 0 0",
    ]))
    assert torch.equal(batch.mask[1, 0], B([
        "1 1 1 1 1 1 0 0",
        "1 1 1 1 1 1 1 0",
        "1 1 1 1 1 1 0 1",
    ]))


def test_window_mask_before_eviction():
    cache = cache_with([5], window=WindowSpec(sink=1, window=3))
    batch = build_batch(cache, 2)
    assert batch.positions.tolist() == [[5, 6]]
    # key positions 0..4 committed, 5..6 in the block; position 5 sees 0 (sink), 3, 4, 5; position 6 sees 0, 4, 5, 6
    assert torch.equal(batch.mask[0, 0], B([
        "1 0 0 1 1 1 0",
        "1 0 0 0 1 1 1",
    ]))


def test_window_mask_after_eviction_follows_slot_positions():
    cache = cache_with([7], window=WindowSpec(sink=1, window=3))
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == [0, 4, 5, 6]  # evicted: slots hold positions 0, 4, 5, 6
    assert cache.next_pos == [7]
    batch = build_batch(cache, 1)
    assert batch.positions.tolist() == [[7]]
    # position 7 sees 0 (sink), 5, 6 and itself; position 4 is 3 away: outside the window
    assert torch.equal(batch.mask[0, 0], B(["1 0 1 1 1"]))


def test_window_mask_inside_one_long_block():
    cache = cache_with([0], window=WindowSpec(sink=1, window=2))
    batch = build_batch(cache, 5)
    assert torch.equal(batch.mask[0, 0], B([
        "1 0 0 0 0",
        "1 1 0 0 0",
        "1 1 1 0 0",
        "1 0 1 1 0",
        "1 0 0 1 1",
    ]))


def test_invalid_n_valid():
    cache = cache_with([0, 0])
    with pytest.raises(ValueError):
        build_batch(cache, 2, n_valid=[2])
    with pytest.raises(ValueError):
        build_batch(cache, 2, n_valid=[3, 1])


def test_scratch_tree_mask_sees_the_trunk_and_each_nodes_path():
    # scratch: 2 pending tokens (trunk), then nodes a (slot 2), b (slot 3, child of a) run by earlier
    # blocks; this block appends c (slot 4, child of b) and d (slot 5, child of a)
    mask = scratch_tree_mask([[2, 3, 4], [5, 2]], trunk=2, width=6)
    assert torch.equal(mask, B([
        "1 1 1 1 1 0",
        "1 1 1 0 0 1",
    ]))
    assert torch.equal(scratch_tree_mask([[1]], trunk=1, width=2), B(["1 1"]))  # a root child after the root


def test_scratch_tree_mask_of_a_drafter_block_is_build_batchs_block_mask():
    # 3 committed tokens; a round wrote 2 pending tokens (positions 3, 4: the root) and one node of
    # depth 1 (slot 2), and now appends two children of depth 2 (offset: depth + pending - 1)
    cache = cache_with([3])
    cache.begin_block(torch.tensor([[3, 4, 5]]))
    batch = build_batch(cache, 2, scratch_tree_mask([[2, 3], [2, 4]], 2, 5), torch.tensor([3, 3]), append=True)
    assert batch.positions.tolist() == [[6, 6]]
    assert torch.equal(batch.mask[0, 0], B([
        "1 1 1 1 1 1 1 0",
        "1 1 1 1 1 1 0 1",
    ]))


def test_window_mask_rule_and_broadcasting():
    pos = torch.arange(6)
    assert torch.equal(window_mask(pos, pos, WindowSpec(sink=1, window=2)), B([
        "1 1 1 1 1 1",
        "1 1 1 1 1 1",
        "1 1 1 1 1 1",
        "1 0 1 1 1 1",
        "1 0 0 1 1 1",
        "1 0 0 0 1 1",
    ]))  # the rule alone: causality comes from elsewhere
    assert torch.equal(window_mask(pos[None, 4:], pos[None], WindowSpec(sink=2, window=1)), B([
        "1 1 0 0 1 1",
        "1 1 0 0 0 1",
    ])[None])
    full = window_mask(torch.zeros(3, 2), torch.zeros(1, 5), None)
    assert full.shape == (3, 2, 5) and full.all()


def test_unrolled_step_masks_of_a_spire_training_forward():
    pos = torch.arange(4)
    # step 1: the target's memories strictly before t, and itself
    assert torch.equal(unrolled_step_mask(pos, 1, None), B([
        "0 0 0 0  1 0 0 0",
        "1 0 0 0  0 1 0 0",
        "1 1 0 0  0 0 1 0",
        "1 1 1 0  0 0 0 1",
    ]))
    # step 3: target memories before t - 2 | step 2's memory at t - 1 | step 1's at t - 2 | itself
    assert torch.equal(unrolled_step_mask(pos, 3, None), B([
        "0 0 0 0  0 0 0 0  0 0 0 0  1 0 0 0",
        "0 0 0 0  1 0 0 0  0 0 0 0  0 1 0 0",
        "0 0 0 0  0 1 0 0  1 0 0 0  0 0 1 0",
        "1 0 0 0  0 0 1 0  0 1 0 0  0 0 0 1",
    ]))
    # a window of 2 after 1 sink: position 3 no longer sees position 1
    assert torch.equal(unrolled_step_mask(pos, 2, WindowSpec(sink=1, window=2)), B([
        "0 0 0 0  0 0 0 0  1 0 0 0",
        "0 0 0 0  1 0 0 0  0 1 0 0",
        "1 0 0 0  0 1 0 0  0 0 1 0",
        "1 0 0 0  0 0 1 0  0 0 0 1",
    ]))


@pytest.mark.parametrize("window", [None, WindowSpec(sink=1, window=3)])
def test_split_pads_short_blocks_of_different_sizes_into_one_call(window):
    """Rows verifying drafts of 1..4 tokens (chains and a tree) in any order attend in one padded call
    under SPLIT, and every real token's attention equals PAD's (which pads every row to the longest); a
    prompt chunk longer than PAD_RUN_TOKENS keeps a call of its own."""
    from specstack.attention import PAD_RUN_TOKENS, attend, row_blocks_batch

    blocks = [[-1], [-1, 0], [-1, 0, 0, 1], [-1], [-1, 0, 1], [-1, 0, 1, 2, 3, 4], [-1, 0]]
    assert max(len(p) for p in blocks if len(p) <= PAD_RUN_TOKENS) == 4
    cache = cache_with([3, 6, 2, 9, 4, 5, 7], window=window, block=9)
    heads, kv, d = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(len(blocks), kv, cache.k.shape[-2], d, generator=g)
    values = torch.randn(len(blocks), kv, cache.k.shape[-2], d, generator=g)
    counts = [len(p) for p in blocks]
    q = torch.randn(1, sum(counts), heads, d, generator=g)

    split = row_blocks_batch(cache, blocks, "split")
    assert [(r.start, r.stop, r.gather is not None) for r in split.runs] == [(0, 5, True), (5, 6, False), (6, 7, False)]
    got = attend(q, keys, values, split)

    pad = row_blocks_batch(cache, blocks, "pad")
    t = max(counts)
    padded = torch.zeros(len(blocks), t, heads, d)
    starts = [sum(counts[:i]) for i in range(len(blocks))]
    for i, (s, c) in enumerate(zip(starts, counts, strict=True)):
        padded[i, :c] = q[0, s : s + c]
    used = pad.mask.shape[-1]  # the cache hands PAD its used slots only
    want = attend(padded, keys[:, :, :used], values[:, :, :used], pad).view(len(blocks), t, heads * d)
    for i, (s, c) in enumerate(zip(starts, counts, strict=True)):
        torch.testing.assert_close(got[s : s + c], want[i, :c], rtol=1e-5, atol=1e-6)


# each row's level: its paths of scratch slots (its nodes' ancestors and themselves), None: the row sits
# the level out; the runs attention makes of them: (first row, last row + 1, padded queries?)
LEVELS = {
    "ragged": ([[[3], [3, 4]], [[3]], None, [[3], [4], [3, 5]]], [(0, 2, True), (3, 4, False)]),
    "even": ([[[3], [3, 4]], [[3], [4]], [[3], [3, 4]], [[3], [4]]], [(0, 4, False)]),
}


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("window", [None, WindowSpec(sink=1, window=4)])
def test_a_packed_level_attends_as_its_padded_block(window, level):
    """Rows' nodes appended to a round's scratch (a draft group's level: attention.packed_append_batch)
    packed without padding, rows of different widths and one row taking none, or all of one width (no
    query padded), give every real token the attention, positions and cache slots build_batch's padded
    block with append gives it; a mask of the wrong shape is refused."""
    from specstack.attention import attend, build_batch, packed_append_batch, scratch_tree_mask

    cache = cache_with([3, 6, 2, 5], window=window, block=6)
    cache.begin_block(torch.zeros(4, 3, dtype=torch.long) + torch.tensor(cache.next_pos).unsqueeze(1))  # a catch-up
    prior = cache.scratch
    paths, want_runs = LEVELS[level]
    trunks = [3, 2, 0 if paths[2] is None else 3, 1]  # each row's pending chain in the catch-up (the rest: padding)
    masks = [None if p is None else scratch_tree_mask(p, n, prior + len(p)) for p, n in zip(paths, trunks, strict=True)]
    offsets = [None if p is None else torch.tensor([len(s) for s in p]) + n - 1 for p, n in zip(paths, trunks, strict=True)]
    counts = [0 if p is None else len(p) for p in paths]
    packed = packed_append_batch(cache, masks, offsets)
    assert packed.counts == tuple(counts) and packed.append
    assert [(r.start, r.stop, r.gather is not None) for r in packed.runs] == want_runs  # an idle row splits a stretch

    t = max(counts)
    inner = torch.zeros(4, t, prior + t, dtype=torch.bool)
    offs = torch.zeros(4, t, dtype=torch.long)
    for r, (m, o) in enumerate(zip(masks, offsets, strict=True)):
        if m is not None:
            inner[r, : len(o), : prior + len(o)], offs[r, : len(o)] = m, o
    padded = build_batch(cache, t, inner, offs, counts, append=True)
    heads, kv, d = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(4, kv, cache.k.shape[-2], d, generator=g)
    values = torch.randn(4, kv, cache.k.shape[-2], d, generator=g)
    q = torch.randn(1, sum(counts), heads, d, generator=g)
    got = attend(q, keys, values, packed)
    q_pad = torch.zeros(4, t, heads, d)
    starts = [sum(counts[:r]) for r in range(4)]
    for r, (s, c) in enumerate(zip(starts, counts, strict=True)):
        q_pad[r, :c] = q[0, s : s + c]
    used = padded.mask.shape[-1]
    want = attend(q_pad, keys[:, :, :used], values[:, :, :used], padded).view(4, t, heads * d)
    for r, (s, c) in enumerate(zip(starts, counts, strict=True)):
        assert torch.equal(packed.positions[0, s : s + c], padded.positions[r, :c])
        torch.testing.assert_close(got[s : s + c], want[r, :c], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mask"):
        packed_append_batch(cache, [masks[0][:, :-1], *masks[1:]], offsets)
