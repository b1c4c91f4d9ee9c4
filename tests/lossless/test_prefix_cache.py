"""The prefix cache (prefix_cache.py) is lossless: in fp32 a row that starts from a cached prefix
decodes exactly as the same prompt read cold, with every drafter, for prefixes ending inside a block, a
prompt seen whole before, a prefix evicted while rows run, n samples of one prompt read once (seeded:
the very tokens of each sample decoded alone; and their distribution), and a cancelled row's part read."""
from __future__ import annotations

import random

import numpy as np
import pytest
from chisq import chi2_pvalue
from lossless.test_batched_drafters import alone
from lossless.test_sampling_equivalence import PROMPT, V, exact_pairs

from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.katz import KatzTrigram
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.ngram import NgramDrafter
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")

_rnd = random.Random(33)
BASE = [_rnd.randrange(3, 257) for _ in range(70)]
GEN = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
BLOCK = 8
MB = 1 << 20
def tail(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 257) for _ in range(n)]


def engine(lm, cache_bytes: int = 64 * MB, **kw) -> BatchEngine:
    return BatchEngine(lm, max_rows=kw.pop("max_rows", 4), max_context=160, step_tokens=kw.pop("step_tokens", 24),
                       prefix_cache=PrefixCache(cache_bytes, block_size=BLOCK), **kw)


def drafters(kind: str, lm, self_drafts):
    """A request's drafter of each kind (a new one per call: each row owns its own)."""
    if kind == "none":
        return None
    if kind == "chain":
        return ModelDrafter(self_drafts, TreeParams.chain(3))
    if kind == "tree":
        return ModelDrafter(self_drafts, TreeParams(width=2, budget=6, depth=3, expand_per_forward=2))
    trigram = KatzTrigram.train([BASE + alone(lm, BASE, GEN), tail(200, 5)], vocab_size=257)
    return NgramDrafter(trigram, widths=(1,) * 6, max_n=6)


@pytest.mark.parametrize("kind", ["none", "chain", "tree", "ngram"])
def test_rows_from_cached_prefixes_decode_as_cold_ones(tiny, self_drafts, kind):
    """One request reads BASE; then, in one batch: BASE again (all but its root cached: the first request's
    prompt and answer were kept when it finished), BASE's first 43 tokens and a new tail (a prefix ending
    inside a block: 3 tokens of the sixth block reused), BASE plus a new tail, and a prompt sharing nothing."""
    draft = self_drafts[tiny.arch]
    eng = engine(tiny.lm)
    first = eng.run([BatchRequest(BASE, GEN, drafter=drafters(kind, tiny.lm, draft))])[0]
    assert first.tokens == alone(tiny.lm, BASE, GEN) and first.stats.cached_tokens == 0
    prompts = [BASE, BASE[:43] + tail(20, 1), BASE + tail(9, 2), tail(30, 3)]
    results = eng.run([BatchRequest(p, GEN, drafter=drafters(kind, tiny.lm, draft)) for p in prompts])
    for i, (p, out) in enumerate(zip(prompts, results, strict=True)):
        assert out.tokens == alone(tiny.lm, p, GEN), f"{kind}: prompt {i}"
    assert [out.stats.cached_tokens for out in results] == [69, 43, 70, 0]
    st = eng.prefix.stats
    assert (st.queries, st.hits, st.cached_tokens) == (5, 3, 69 + 43 + 70)


def test_a_prefix_evicted_while_rows_run(tiny):
    """A budget of five blocks. B copies A's prompt from the cache; then C's prompt, read while B decodes,
    evicts A's blocks: B needs none of them (it holds its copy) and decodes as cold, as do A and C; the
    cache never holds more than its budget."""
    kv = tiny.lm.model.new_cache(1, BLOCK)
    block_bytes = 2 * kv.k[:, 0].nbytes
    eng = engine(tiny.lm, cache_bytes=5 * block_bytes, max_rows=2, step_tokens=16)
    a, b, c = tail(40, 0), tail(40, 0) + tail(10, 1), tail(60, 2)
    first = eng.run([BatchRequest(a, GEN)])[0]
    assert eng.prefix.tokens == 40  # A's prompt and answer would take six blocks: five fit
    hb, hc = eng.add(BatchRequest(b, GEN)), eng.add(BatchRequest(c, GEN))
    evicted_while_b_ran = False
    while eng.busy:
        before = eng.prefix.stats.evicted_blocks
        eng.step()
        b_runs = any(row.handle == hb for row in eng.rows)
        evicted_while_b_ran |= b_runs and eng.prefix.stats.evicted_blocks > before
        assert eng.prefix.nbytes <= 5 * block_bytes
    assert evicted_while_b_ran
    out_b, out_c = eng.pop_result(hb), eng.pop_result(hc)
    assert out_b.stats.cached_tokens == 40
    for p, out in [(a, first), (b, out_b), (c, out_c)]:
        assert out.tokens == alone(tiny.lm, p, GEN)


def test_n_samples_of_one_prompt_read_it_once(tiny):
    """Four seeded samples of one prompt, admitted together: the oldest reads the prompt while the others
    wait, then they copy all of it but their root, and each emits the tokens of its seed alone."""
    gens = [GenerationConfig(max_new_tokens=10, stop_on_eos=False,
                             sampling=SamplingParams(temperature=1.0, seed=100 + i)) for i in range(4)]
    eng = engine(tiny.lm, step_tokens=16)
    results = eng.run([BatchRequest(BASE, g) for g in gens])
    for g, out in zip(gens, results, strict=True):
        assert out.tokens == alone(tiny.lm, BASE, g)
    assert [out.stats.cached_tokens for out in results] == [0, 69, 69, 69]
    # the prompt's 70 tokens once, then each sample's root: the forwards read 70 + 3 * 1 prompt tokens
    decode = sum(len(out.tokens) for out in results) - 4  # each row's first token comes with its prompt's end
    assert eng.stats.tokens == 70 + 3 * 1 + decode


def test_without_a_prefix_cache_every_sample_reads_the_prompt(tiny):
    """The same four samples with no cache read 4 x 70 prompt tokens (what the test above saves)."""
    gen = GenerationConfig(max_new_tokens=10, stop_on_eos=False, sampling=SamplingParams(temperature=1.0, seed=1))
    eng = BatchEngine(tiny.lm, max_rows=4, max_context=160, step_tokens=16)
    results = eng.run([BatchRequest(BASE, gen)] * 4)
    assert eng.stats.tokens == 4 * 70 + sum(len(out.tokens) - 1 for out in results)


def test_a_cancelled_rows_read_part_serves_the_next_request(tiny):
    """A row cancelled halfway through its prompt leaves its row at once, and what it read is kept: the
    same prompt sent again copies it (whole blocks) and decodes as cold."""
    eng = engine(tiny.lm, step_tokens=24)
    h = eng.add(BatchRequest(BASE, GEN))
    eng.step()  # 24 prompt tokens read
    assert eng.cancel(h) and eng.running == 0 and eng.cache.batch_size == 0
    assert eng.prefix.tokens == 24
    out = eng.run([BatchRequest(BASE, GEN)])[0]
    assert out.tokens == alone(tiny.lm, BASE, GEN) and out.stats.cached_tokens == 24


def test_a_spire_draft_reads_its_prompt_without_the_cache(tiny_llama, spire_drafts):
    """A drafter that reads the target's activations takes no prefix (the cache keeps keys and values
    only): its row reads the prompt as without a cache, and decodes as cold."""
    eng = engine(tiny_llama.lm)
    eng.run([BatchRequest(BASE, GEN)])
    out = eng.run([BatchRequest(BASE, GEN, drafter=ModelDrafter(spire_drafts["spire"], TreeParams.chain(3)))])[0]
    assert out.tokens == alone(tiny_llama.lm, BASE, GEN) and out.stats.cached_tokens == 0


def test_samples_sharing_a_cached_prefix_follow_the_targets_distribution(vocab8):
    """Rows of one prompt, most copying its first tokens from the cache, emit pairs (x1, x2) distributed as
    p(x1) p(x2 | x1) (chi-square, alpha 1e-4)."""
    target, _ = vocab8
    sampling = SamplingParams(temperature=1.0)
    rows = 1500
    requests = [BatchRequest(PROMPT, GenerationConfig(max_new_tokens=2, stop_on_eos=False,
                                                      sampling=SamplingParams(temperature=1.0, seed=70_000 + i)))
                for i in range(rows)]
    eng = BatchEngine(target, max_rows=64, max_context=16, prefix_cache=PrefixCache(MB, block_size=2))
    results = eng.run(requests)
    assert sum(out.stats.cached_tokens for out in results) >= 2 * (rows - 1)
    counts = np.zeros((V, V))
    for out in results:
        counts[out.tokens[0], out.tokens[1]] += 1
    assert chi2_pvalue(counts, exact_pairs(target, sampling)) > 1e-4


@pytest.mark.parametrize("kind", ["chain-group", "tree"])
def test_a_draft_models_own_prefix_cache_drafts_what_a_cold_draft_drafts(tiny, self_drafts, kind):
    """Drafters sharing a draft prefix cache (the draft's keys and values, not the target's) copy a cached
    prompt instead of running it: the outputs equal cold decoding, and so does every step's accepted
    count, which a wrong draft key or position would change (the output alone would not show it)."""
    from specstack.drafting.model import chain_members

    draft = self_drafts[tiny.arch]

    def factory(prefix):
        if kind == "chain-group":
            return chain_members(draft, 3, None, prefix)
        return lambda: ModelDrafter(draft, TreeParams(width=2, budget=6, depth=3, expand_per_forward=2), prefix=prefix)

    prompts = [BASE, BASE + tail(9, 2), BASE[:43] + tail(20, 1), BASE]
    runs = {}
    for cached in (False, True):
        prefix = PrefixCache(64 * MB, block_size=BLOCK) if cached else None
        eng = engine(tiny.lm, drafters=factory(prefix))
        first = eng.run([BatchRequest(BASE, GEN)])
        runs[cached] = first + eng.run([BatchRequest(p, GEN) for p in prompts])
        if cached:
            assert prefix.stats.hits >= 4 and prefix.stats.cached_tokens >= 69 + 70 + 43 + 69
    for i, (cold, warm) in enumerate(zip(runs[False], runs[True], strict=True)):
        assert warm.tokens == cold.tokens == alone(tiny.lm, ([BASE] + prompts)[i], GEN), f"prompt {i}"
        assert [s.accepted for s in warm.stats.steps] == [s.accepted for s in cold.stats.steps], f"prompt {i}"
