"""τ measured with the engine (specstack/throughput/measure_tau.py) on the tiny random Llama (fp32): the
MagicDec drafter is the target itself behind a sliding-window KV, so with a window covering the whole
context it agrees with the target on every token, and with a small one it still never changes the
output (verification is lossless) while its cache really evicts."""
from __future__ import annotations

import torch

from specstack.config import GenerationConfig, WindowSpec
from specstack.engine.batched import generate
from specstack.throughput.measure_tau import (
    magicdec_drafters,
    measure_tau,
    sparse_self_drafter,
)
from specstack.throughput.model import ENGINE


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_full_window_self_draft_is_accepted_every_time(tiny_llama):
    k, new = 3, 16  # 16 tokens = 4 full rounds of k + 1
    lm = tiny_llama.lm
    prompts = _prompts(lm.config.vocab_size, [5, 9])
    m = measure_tau("magicdec", lm, lambda _ids: sparse_self_drafter(lm, k, WindowSpec(1, 10_000)), prompts, new)
    assert (m.new_tokens, m.prompts) == (2 * new, 2)
    assert m.tau == k + 1


def test_sparse_self_draft_is_lossless_and_evicts(tiny_llama):
    k, new = 4, 24
    lm = tiny_llama.lm
    prompts = _prompts(lm.config.vocab_size, [48, 64])
    made = []
    make = magicdec_drafters(lm, k, ENGINE)

    def keep(ids):
        made.append(make(ids))
        return made[-1]

    m = measure_tau("magicdec", lm, keep, prompts, new)
    assert 1 <= m.tau <= k + 1
    for ids, drafter in zip(prompts, made, strict=True):
        window = drafter.cache.window
        assert window == WindowSpec(1, len(ids) // 8)  # sink 1 + L // 8 positions
        assert drafter.cache.lengths[0] < len(ids)  # it evicted: far fewer slots than the prompt alone

    for ids in prompts:
        gen = GenerationConfig(max_new_tokens=new, stop_on_eos=False)
        assert generate(lm, ids, gen, drafter=make(ids)).tokens == generate(lm, ids, gen).tokens
