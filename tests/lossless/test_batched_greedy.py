"""The batched engine (engine/batched.py) is lossless row by row: in fp32 every row's greedy output
equals that prompt decoded alone by `generate`, for rows of very different prompt lengths, in both
ragged layouts (PAD, SPLIT) and the automatic choice, with chunked prefill beside decoding rows, rows
finishing early and new rows admitted mid-flight, cancelled rows, and rows that speculate (a model
drafter's trees beside plain rows in one forward)."""
from __future__ import annotations

import random

import pytest

from specstack.config import GenerationConfig
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine.batched import BatchEngine, BatchRequest, generate, generate_batch

pytestmark = pytest.mark.usefixtures("one_thread")

_rnd = random.Random(7)
PROMPTS = [[_rnd.randrange(3, 257) for _ in range(n)] for n in (1, 89, 2, 34, 5, 55, 13, 3, 21, 8)]
_alone: dict[tuple, list[int]] = {}


def alone(tiny, prompt: list[int], gen: GenerationConfig) -> list[int]:
    key = (tiny.arch, tuple(prompt), gen)
    if key not in _alone:
        _alone[key] = generate(tiny.lm, prompt, gen).tokens
    return _alone[key]


@pytest.mark.parametrize("layout", ["pad", "split", "auto"])
def test_batched_greedy_equals_each_row_alone(tiny, layout):
    # max_new differs per row: rows finish at different steps and queued prompts take their slots
    gens = [GenerationConfig(max_new_tokens=8 + 5 * (i % 4), stop_on_eos=False) for i in range(len(PROMPTS))]
    engine = BatchEngine(tiny.lm, max_rows=4, max_context=160, layout=layout, step_tokens=16)
    seen_rows = []
    results = engine.run([BatchRequest(p, g) for p, g in zip(PROMPTS, gens, strict=True)],
                         on_step=lambda e, _: seen_rows.append(e.cache.batch_size))
    for i, (prompt, gen, out) in enumerate(zip(PROMPTS, gens, results, strict=True)):
        assert out.tokens == alone(tiny, prompt, gen), f"row {i} (prompt of {len(prompt)} tokens)"
        assert out.finish_reason == "length"
    assert max(seen_rows) == 4 and engine.cache.batch_size == 0
    assert engine.stats.recent[0].rows == 4  # four rows started together, the rest joined later
    if layout == "auto":
        assert set(engine.stats.layouts) == {"pad", "split"}  # uniform steps pad, ragged steps split


def test_row_admitted_mid_flight_decodes_as_alone(tiny):
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    engine = BatchEngine(tiny.lm, max_rows=3, max_context=160, step_tokens=8)
    first = [engine.add(BatchRequest(p, gen)) for p in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    late = engine.add(BatchRequest(PROMPTS[3], gen))  # 34 prompt tokens: read in chunks of 8 while others decode
    while engine.busy:
        engine.step()
    for h, p in zip([*first, late], [PROMPTS[0], PROMPTS[1], PROMPTS[3]], strict=True):
        assert engine.pop_result(h).tokens == alone(tiny, p, gen)


def test_cancel_between_steps_frees_the_row(tiny):
    gen = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    engine = BatchEngine(tiny.lm, max_rows=3, max_context=160)
    handles = [engine.add(BatchRequest(p, gen)) for p in PROMPTS[:5]]  # the 4th and 5th wait
    engine.step()
    engine.step()
    assert engine.running == 3 and engine.waiting == 2
    assert engine.cancel(handles[0])  # a running row: free at once, the 4th request takes it next step
    assert engine.running == 2 and engine.cache.batch_size == 2
    assert engine.cancel(handles[4])  # a waiting request: it never runs
    assert engine.waiting == 1
    assert not engine.cancel(handles[4]) and not engine.cancel(12345)  # gone, unknown
    while engine.busy:
        engine.step()
    assert engine.pop_result(handles[0]) is None and engine.pop_result(handles[4]) is None
    for h, p in zip(handles[1:4], PROMPTS[1:4], strict=True):
        assert engine.pop_result(h).tokens == alone(tiny, p, gen)


def test_speculating_rows_beside_plain_rows(tiny, self_drafts):
    """Rows with a draft model's trees (ragged blocks: root + tree) and plain rows share forwards."""
    gen = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    shapes = [TreeParams.chain(3), None, TreeParams(width=2, budget=6, depth=3, expand_per_forward=1), None]
    for layout in ("pad", "split"):
        requests = [BatchRequest(p, gen, drafter=ModelDrafter(self_drafts[tiny.arch], s) if s else None)
                    for p, s in zip(PROMPTS[4:8], shapes, strict=True)]
        results = BatchEngine(tiny.lm, max_rows=4, max_context=160, layout=layout).run(requests)
        for p, out in zip(PROMPTS[4:8], results, strict=True):
            assert out.tokens == alone(tiny, p, gen), layout


def test_generate_batch_stops_each_row_on_its_own(tiny):
    """EOS and length end rows independently; with stop_on_eos every row matches its lone decode."""
    gens = [GenerationConfig(max_new_tokens=n) for n in (3, 40, 1, 25)]
    results = generate_batch(tiny.lm, PROMPTS[:4], gens, batch_size=4)
    for p, g, out in zip(PROMPTS[:4], gens, results, strict=True):
        assert out.tokens == alone(tiny, p, g)
        assert len(out.tokens) <= g.max_new_tokens
