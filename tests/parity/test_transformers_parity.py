"""specstack's decoder against transformers on the same (tiny, random, fp32) weights: prefill, decode,
tree scoring with compaction, ragged batches, greedy generation and hidden states (DESIGN §3)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from families import ALL_FAMILIES

from specstack.attention import build_batch, tree_batch
from specstack.config import GenerationConfig
from specstack.engine.batched import generate


@pytest.fixture(params=ALL_FAMILIES)
def tiny(request: pytest.FixtureRequest, tiny_models):
    """Every parity test runs on every family of the architecture table (models/architectures.py)."""
    return tiny_models[request.param]


ATOL = 1e-4
RTOL = 1e-4

# A branching tree hanging off the last committed token: node 0 is the next token (child of the
# root); nodes 1, 2 are its children; 3, 4 children of 1; 5 of 2; 6 of 3; 7 of 5.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 257, (n,), generator=g).tolist()


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node ids from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item() if ours.numel() else 0.0
    assert torch.allclose(ours, ref, atol=ATOL, rtol=RTOL), f"{what}: max |diff| {err:.3g}"


def test_prefill(tiny):
    prompt = ids(23, seed=1)
    model = tiny.lm.model
    cache = model.new_cache(1)
    logits = model.extend(torch.tensor([prompt]), cache).logits[0]
    assert logits.shape == (23, 257) and logits.dtype == torch.float32
    assert_close(logits, tiny.hf_logits(prompt), "prefill")
    assert cache.lengths == [23] and cache.next_pos == [23]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == list(range(23))


def test_decode_step_by_step(tiny):
    seq = ids(30, seed=2)
    ref = tiny.hf_logits(seq)
    model = tiny.lm.model
    cache = model.new_cache(1, capacity=64)
    out = model.extend(torch.tensor([seq[:7]]), cache).logits[0]
    assert_close(out, ref[:7], "prefix")
    for i in range(7, len(seq)):
        step = model.extend(torch.tensor([[seq[i]]]), cache).logits[0, -1]
        assert_close(step, ref[i], f"decode position {i}")
    assert cache.lengths == [30] and cache.next_pos == [30]


@pytest.mark.parametrize("accepted", [[0, 2, 5, 7], [0, 1, 3, 6], [0, 1, 4], [0]])
def test_tree_forward_and_commit(tiny, accepted):
    prompt = ids(9, seed=3)
    tree_tokens = ids(len(PARENTS), seed=4)
    model = tiny.lm.model
    cache = model.new_cache(1, capacity=64)
    model.extend(torch.tensor([prompt]), cache)

    batch = tree_batch(cache, PARENTS)
    assert batch.positions[0].tolist() == [9, 10, 10, 11, 11, 11, 12, 12]  # root position + depth - 1
    logits = model.forward(torch.tensor([tree_tokens]), batch, cache).logits[0]
    for node in range(len(PARENTS)):
        seq = prompt + [tree_tokens[j] for j in path_to(node, PARENTS)]
        assert_close(logits[node], tiny.hf_logits(seq)[-1], f"tree node {node}")

    # keep one root-to-node path: its K/V are compacted behind the prompt, everything else is dead
    cache.commit_nodes(0, accepted)
    n = len(prompt) + len(accepted)
    assert cache.lengths == [n] and cache.next_pos == [n]
    assert cache.slot_pos[0, : cache.lengths[0]].tolist() == list(range(n))
    seq = prompt + [tree_tokens[j] for j in accepted]
    nxt = ids(2, seed=5)
    for k, tok in enumerate(nxt):
        step = model.extend(torch.tensor([[tok]]), cache).logits[0, -1]
        assert_close(step, tiny.hf_logits(seq + nxt[: k + 1])[-1], f"decode {k} after committing {accepted}")


def test_two_tree_rounds(tiny):
    """A second tree after a commit reuses the scratch slots of the first (dead nodes must not leak)."""
    prompt = ids(6, seed=6)
    model = tiny.lm.model
    cache = model.new_cache(1, capacity=64)
    model.extend(torch.tensor([prompt]), cache)
    seq = list(prompt)
    for rnd, accepted in enumerate(([0, 2, 5], [0, 1, 3, 6])):
        toks = ids(len(PARENTS), seed=10 + rnd)
        logits = model.forward(torch.tensor([toks]), tree_batch(cache, PARENTS), cache).logits[0]
        for node in range(len(PARENTS)):
            ref = tiny.hf_logits(seq + [toks[j] for j in path_to(node, PARENTS)])[-1]
            assert_close(logits[node], ref, f"round {rnd} node {node}")
        cache.commit_nodes(0, accepted)
        seq += [toks[j] for j in accepted]
    step = model.extend(torch.tensor([[7]]), cache).logits[0, -1]
    assert_close(step, tiny.hf_logits(seq + [7])[-1], "decode after two rounds")


def test_ragged_batch(tiny):
    """Rows of different lengths in one cache, padded on the right; each row equals itself run alone."""
    model = tiny.lm.model
    lens = [7, 12, 4]
    prompts = [ids(n, seed=20 + i) for i, n in enumerate(lens)]
    junk = ids(12, seed=30)  # padding tokens: arbitrary, they must not influence any real row
    t = max(lens)
    cache = model.new_cache(3, capacity=64)
    tokens = torch.tensor([p + junk[: t - len(p)] for p in prompts])
    logits = model.forward(tokens, build_batch(cache, t, n_valid=lens), cache).logits
    for b, p in enumerate(prompts):
        assert_close(logits[b, : len(p)], tiny.hf_logits(p), f"row {b} prefill")
    cache.commit_prefix(lens)
    assert cache.lengths == lens and cache.next_pos == lens

    seqs = [list(p) for p in prompts]
    # decode steps with a different number of new tokens per row (as after ragged acceptance)
    for step, n_new in enumerate(([1, 3, 2], [2, 0, 3], [1, 1, 1])):
        t = max(n_new)
        new = [ids(t, seed=40 + 3 * step + b) for b in range(3)]
        batch = build_batch(cache, t, n_valid=n_new)
        for b in range(3):
            assert batch.positions[b, : n_new[b]].tolist() == list(range(len(seqs[b]), len(seqs[b]) + n_new[b]))
        logits = model.forward(torch.tensor(new), batch, cache).logits
        for b in range(3):
            seqs[b] += new[b][: n_new[b]]
            if n_new[b]:
                ref = tiny.hf_logits(seqs[b])[-n_new[b]:]
                assert_close(logits[b, : n_new[b]], ref, f"row {b} step {step}")
        cache.commit_prefix(n_new)
        assert cache.lengths == [len(s) for s in seqs] == cache.next_pos


def test_ragged_batch_near_the_context_limit(tiny):
    """A short step of a row close to max_seq_len, padded to a longer row's step: the padding must not
    reach positions past the model's position tables. (The padded slots still need cache room, so
    the cache gets headroom past max_seq_len.)"""
    model = tiny.lm.model
    max_len = tiny.lm.config.max_seq_len
    long, short = ids(max_len - 6, seed=80), ids(10, seed=81)
    cache = model.new_cache(2, capacity=max_len + 8)
    t = len(long)
    model.forward(torch.tensor([long, short + [0] * (t - 10)]), build_batch(cache, t, n_valid=[t, 10]), cache)
    cache.commit_prefix([t, 10])
    new = [ids(8, seed=82), ids(8, seed=83)]
    logits = model.forward(torch.tensor(new), build_batch(cache, 8, n_valid=[1, 8]), cache).logits
    assert_close(logits[0, 0], tiny.hf_logits(long + new[0][:1])[-1], "long row")
    assert_close(logits[1], tiny.hf_logits(short + new[1])[-8:], "short row")


def test_tree_in_a_ragged_batch(tiny):
    """The same tree shape in two rows of different lengths, each row keeping a different path."""
    model = tiny.lm.model
    prompts = [ids(9, seed=50), ids(5, seed=51)]
    cache = model.new_cache(2, capacity=64)
    tokens = torch.tensor([prompts[0], prompts[1] + [0] * 4])
    model.forward(tokens, build_batch(cache, 9, n_valid=[9, 5]), cache)
    cache.commit_prefix([9, 5])
    toks = [ids(len(PARENTS), seed=52), ids(len(PARENTS), seed=53)]
    logits = model.forward(torch.tensor(toks), tree_batch(cache, PARENTS), cache).logits
    for b in range(2):
        for node in range(len(PARENTS)):
            ref = tiny.hf_logits(prompts[b] + [toks[b][j] for j in path_to(node, PARENTS)])[-1]
            assert_close(logits[b, node], ref, f"row {b} node {node}")
    accepted = [[0, 2, 5, 7], [0, 1, 4]]
    for b in (1, 0):
        cache.commit_nodes(b, accepted[b])
    seqs = [prompts[b] + [toks[b][j] for j in accepted[b]] for b in range(2)]
    assert cache.lengths == [len(s) for s in seqs]
    nxt = [[11], [12]]
    logits = model.extend(torch.tensor(nxt), cache).logits
    for b in range(2):
        assert_close(logits[b, -1], tiny.hf_logits(seqs[b] + nxt[b])[-1], f"row {b} decode after commit")


def _hf_greedy(tiny, prompt: list[int], n: int, eos: int | None) -> list[int]:
    gc = copy.deepcopy(tiny.hf.generation_config)
    # eos_token_id=None would fall back to the model's default; [] really disables stopping
    gc.do_sample, gc.max_new_tokens, gc.pad_token_id = False, n, 0
    gc.eos_token_id = [] if eos is None else eos
    with torch.no_grad():
        out = tiny.hf.generate(torch.tensor([prompt]), generation_config=gc)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_hf(tiny):
    prompt = ids(10, seed=60)
    ours = generate(tiny.lm, prompt, GenerationConfig(max_new_tokens=20, stop_on_eos=False))
    ref = _hf_greedy(tiny, prompt, 20, eos=None)
    assert len(ref) == 20
    assert ours.tokens == ref
    assert ours.finish_reason == "length"
    assert ours.stats.new_tokens == 20 and ours.stats.target_forwards == 19


def test_greedy_generation_stops_at_eos_like_hf(tiny):
    prompt = ids(10, seed=61)
    full = _hf_greedy(tiny, prompt, 20, eos=None)
    # make the first token that appears at index >= 2 (for the first time) the end-of-sequence token
    k = next(i for i in range(2, 20) if full[i] not in full[:i])
    eos = full[k]
    lm = replace(tiny.lm, config=replace(tiny.lm.config, eos_token_ids=(eos,)))
    ours = generate(lm, prompt, GenerationConfig(max_new_tokens=20, stop_on_eos=True))
    ref = _hf_greedy(tiny, prompt, 20, eos=eos)
    assert ref == full[: k + 1]  # HF keeps the eos token ...
    assert ours.tokens == ref[:-1]  # ... specstack reports it as the finish reason
    assert ours.finish_reason == "eos"


def test_hidden_states(tiny):
    prompt = ids(15, seed=70)
    model = tiny.lm.model
    n = tiny.lm.config.n_layers
    with torch.no_grad():
        ref = tiny.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(ref) == n + 1
    out = model.extend(torch.tensor([prompt]), model.new_cache(1), hidden_layers=range(n + 1))
    assert sorted(out.hidden) == list(range(n + 1))
    for i in range(n):  # 0 = embeddings (+ learned positions for gpt2), i = output of block i
        assert_close(out.hidden[i][0], ref[i][0], f"hidden {i}")
    # transformers applies the final norm to its last hidden state; specstack returns the raw block output
    assert_close(model.norm(out.hidden[n])[0], ref[n][0], f"hidden {n} (normed)")

    sub = model.extend(torch.tensor([prompt]), model.new_cache(1), hidden_layers=[1])
    assert list(sub.hidden) == [1]
    assert torch.equal(sub.hidden[1], out.hidden[1])


@pytest.mark.parametrize("rows,expect", [(slice(-1, None), [22]), (slice(0, 0), []), (slice(3, 6), [3, 4, 5])])
def test_logits_of_chosen_rows_only(tiny, rows, expect):
    """A prefill asks for the last row (autoregressive) or none (speculative): the rows it gets are
    the full forward's rows, and the cache it leaves is the same."""
    prompt = ids(23, seed=80)
    model = tiny.lm.model
    full_cache, part_cache = model.new_cache(1), model.new_cache(1)
    full = model.extend(torch.tensor([prompt]), full_cache).logits[0]
    part = model.extend(torch.tensor([prompt]), part_cache, logit_rows=rows).logits[0]
    assert part.shape == (len(expect), 257)
    assert_close(part, full[expect], "chosen rows")  # (a 1-row matmul may round differently from a 23-row one)
    assert part_cache.lengths == full_cache.lengths == [23]
    nxt = torch.tensor([[prompt[0]]])
    assert torch.equal(model.extend(nxt, part_cache).logits, model.extend(nxt, full_cache).logits)
