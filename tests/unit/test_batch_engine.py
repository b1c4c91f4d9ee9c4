"""The batched engine's lifecycle and its refusals (engine/batched.py, cache.py rows): bad requests
are refused with a clear error before they touch the batch, and the rows already decoding go on
unharmed; the cache's rows are allocated once and freed rows are reused."""
from __future__ import annotations

import pytest
import torch

from specstack.config import GenerationConfig
from specstack.engine.autoregressive import generate
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.errors import SpecstackError

GEN = GenerationConfig(max_new_tokens=6, stop_on_eos=False)


def test_bad_requests_are_refused_and_the_batch_goes_on(tiny_llama):
    lm = tiny_llama.lm
    engine = BatchEngine(lm, max_rows=2, max_context=32, max_queue=1)
    ok = engine.add(BatchRequest([5, 6, 7], GEN))
    engine.step()
    with pytest.raises(SpecstackError, match="empty"):
        engine.add(BatchRequest([], GEN))
    with pytest.raises(SpecstackError, match="context limit of 32"):
        engine.add(BatchRequest(list(range(3, 35)), GEN))
    queued = engine.add(BatchRequest([9, 9], GEN))  # joins: a free row
    engine.step()
    waiting = engine.add(BatchRequest([8], GEN))  # both rows busy: it waits
    with pytest.raises(SpecstackError, match="queue is full"):
        engine.add(BatchRequest([8, 8], GEN))
    while engine.busy:
        engine.step()
    for h, p in ((ok, [5, 6, 7]), (queued, [9, 9]), (waiting, [8])):
        assert engine.pop_result(h).tokens == generate(lm, p, GEN).tokens


@pytest.mark.parametrize("kwargs, match", [(dict(max_rows=0), "at least one row"),
                                           (dict(layout="diagonal"), "unknown layout"),
                                           (dict(prefill_chunk=0), "prefill chunk"),
                                           (dict(max_context=1), "at least 2 tokens")])
def test_bad_engine_settings(tiny_llama, kwargs, match):
    with pytest.raises(SpecstackError, match=match):
        BatchEngine(tiny_llama.lm, **kwargs)


def test_a_batch_over_the_memory_budget_is_refused(tiny_llama):
    from specstack.engine.batched import kv_cache_bytes

    need = kv_cache_bytes(tiny_llama.lm, 8, 64 + 128)  # 8 rows of 64 tokens plus one block of scratch
    BatchEngine(tiny_llama.lm, max_rows=8, max_context=64, max_kv_bytes=need)
    with pytest.raises(SpecstackError, match=r"KV cache for 8 rows of 64 tokens needs .* over the budget"):
        BatchEngine(tiny_llama.lm, max_rows=8, max_context=64, max_kv_bytes=need - 1)


def test_max_new_tokens_capped_by_the_row_context(tiny_llama):
    engine = BatchEngine(tiny_llama.lm, max_rows=1, max_context=20)
    out = engine.run([BatchRequest(list(range(3, 18)), GenerationConfig(max_new_tokens=50, stop_on_eos=False))])[0]
    assert len(out.tokens) == 5 and out.finish_reason == "length"


def test_cache_rows_are_allocated_once_and_reused(tiny_llama):
    model = tiny_llama.lm.model
    cache = model.new_cache(0, 16, max_rows=3)
    k_ptr = cache.k.data_ptr()
    rows = [cache.add_row() for _ in range(3)]
    assert rows == [0, 1, 2]
    with pytest.raises(SpecstackError, match="all 3 rows"):
        cache.add_row()
    for r, n in enumerate((2, 5, 3)):  # distinct contents per row
        cache.k[:, r, :, :n] = r + 1
        cache.lengths[r] = cache.next_pos[r] = n
    assert cache.remove_row(0) == 2  # the last row moves into the freed slot
    assert cache.lengths == [3, 5] and torch.all(cache.k[:, 0, :, :3] == 3)
    assert cache.remove_row(1) is None and cache.lengths == [3]
    assert cache.add_row() == 1 and cache.lengths == [3, 0]
    assert cache.k.data_ptr() == k_ptr


def test_prompts_are_read_oldest_request_first(tiny_llama):
    """The step's prefill budget goes to the oldest request still reading its prompt, whatever its slot:
    when A leaves, the newest row C moves into A's slot, ahead of B in slot order, yet B (older, and
    ahead by one chunk) gets its first token first. In slot order C would take every chunk until done."""
    lm = tiny_llama.lm
    engine = BatchEngine(lm, max_rows=3, max_context=64, prefill_chunk=4)
    a = engine.add(BatchRequest([5], GenerationConfig(max_new_tokens=1, stop_on_eos=False)))
    b = engine.add(BatchRequest(list(range(3, 23)), GEN))
    c = engine.add(BatchRequest(list(range(4, 24)), GEN))
    assert [h for h, _ in engine.step()] == [a]  # A decoded at once; B read a chunk, C nothing
    assert [row.handle for row in engine.rows] == [c, b]  # C took A's slot
    while not any(engine.emitted().values()):
        engine.step()
    assert engine.emitted() == {b: 1, c: 0}
    while engine.busy:
        engine.step()
    for h, p in ((b, list(range(3, 23))), (c, list(range(4, 24)))):
        assert engine.pop_result(h).tokens == generate(lm, p, GEN).tokens
