"""The one warp (DESIGN §2.2): temperature, top-k, top-p and greedy, checked against their definitions
and against transformers' logits warpers; seeded sampling in `generate`; and a statistical test that
the autoregressive sampler's first token follows warp(p)."""
from __future__ import annotations

import pytest
import torch

from specstack.config import GenerationConfig, SamplingParams
from specstack.engine.batched import generate
from specstack.errors import SpecstackError
from specstack.sampling import make_generator, sample, warp
from specstack.tree import DraftTree
from specstack.verify import verify_tree


def logits(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def emitted(row: torch.Tensor, params: SamplingParams) -> int:
    """The token the engine emits after these logits with nothing drafted (an `ar` step)."""
    return verify_tree(DraftTree(), row.unsqueeze(0), params, make_generator(params)).next_token


def test_greedy_is_one_hot_of_the_first_argmax():
    x = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 1.0]])
    p = warp(x, SamplingParams())
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert [emitted(x[r], SamplingParams()) for r in range(2)] == [1, 0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_only_is_softmax(temperature):
    x = logits(3, 5, 50, seed=1)
    p = warp(x, SamplingParams(temperature=temperature))
    assert p.shape == x.shape and p.dtype == torch.float32
    torch.testing.assert_close(p, torch.softmax(x / temperature, dim=-1))
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 5))


@pytest.mark.parametrize("k", [1, 5, 49, 50, 80])
def test_top_k_keeps_exactly_the_k_largest(k):
    x = logits(4, 50, seed=2)
    p = warp(x, SamplingParams(temperature=0.7, top_k=k))
    kk = min(k, 50)
    top = x.topk(kk, dim=-1).indices
    assert ((p > 0).sum(-1) == kk).all()
    assert torch.equal(p.gather(-1, top) > 0, torch.ones(4, kk, dtype=torch.bool))
    # kept tokens keep their relative probabilities
    expected = torch.zeros_like(p).scatter(-1, top, torch.softmax(x.gather(-1, top) / 0.7, dim=-1))
    torch.testing.assert_close(p, expected)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.9, 0.999])
def test_top_p_keeps_the_minimal_prefix_reaching_p(top_p):
    x = logits(6, 40, seed=3)
    p = warp(x, SamplingParams(temperature=1.0, top_p=top_p))
    full = torch.softmax(x, dim=-1)
    for row in range(6):
        order = full[row].argsort(descending=True)
        cum = full[row][order].cumsum(0)
        n_keep = int((cum < top_p).sum()) + 1  # the smallest m with mass of the top m >= top_p
        kept = set(order[:n_keep].tolist())
        assert set(torch.nonzero(p[row]).flatten().tolist()) == kept
        assert full[row][list(kept)].sum() >= top_p
        torch.testing.assert_close(p[row][order[:n_keep]], full[row][order[:n_keep]] / cum[n_keep - 1])
    torch.testing.assert_close(p.sum(-1), torch.ones(6))


def test_top_p_on_a_hand_worked_distribution():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    x = probs.log()
    p = warp(x, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 = 0.7 < 0.8 -> keep three
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85)
    p = warp(x, SamplingParams(temperature=1.0, top_p=0.5))  # the first token alone reaches 0.5
    torch.testing.assert_close(p, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("t,k,p", [(0.8, 10, 0.9), (1.3, 0, 0.7), (0.5, 20, 1.0), (1.0, 3, 0.5)])
def test_matches_transformers_warpers(t, k, p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = logits(8, 100, seed=4)
    y = TemperatureLogitsWarper(t)(None, x.clone())
    if k:
        y = TopKLogitsWarper(k)(None, y)
    if p < 1:
        y = TopPLogitsWarper(p)(None, y)
    torch.testing.assert_close(warp(x, SamplingParams(temperature=t, top_k=k, top_p=p)), torch.softmax(y, -1))


@pytest.mark.parametrize("top_p", [1e-30, 1e-46, 5e-324])
def test_the_tiniest_nucleus_keeps_the_most_likely_token(top_p):
    """Any top_p in (0, 1] leaves a distribution: at least the most likely token (ties: the first, as
    argmax). 1e-46 and 5e-324 round to 0 in float32, where the old comparison dropped every token
    and the warp returned NaN."""
    x = logits(3, 50, seed=6)
    x[2, 7] = x[2, 9] = x[2].max() + 1  # a tie for the top
    p = warp(x, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(p, torch.nn.functional.one_hot(x.argmax(-1), 50).float())
    assert [emitted(x[r], SamplingParams(temperature=1.0, top_p=top_p)) for r in range(3)] == x.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-30, 1e-3])
def test_a_tiny_temperature_is_the_argmax_without_overflow(temperature):
    x = logits(2, 50, seed=7, scale=30.0)
    p = warp(x, SamplingParams(temperature=temperature))
    assert torch.equal(p, torch.nn.functional.one_hot(x.argmax(-1), 50).float())


@pytest.mark.parametrize("kw, message", [
    ({"temperature": -1.0}, "temperature must be >= 0, got -1"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": 1e-38}, "temperature must be 0 (greedy) or >= 1e-30"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"top_k": 2.0}, "top_k must be an integer, got 2.0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": float("inf")}, "top_p must be a finite number"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"seed": 2**64}, "seed must be <= 18446744073709551615, got 18446744073709551616"),
    ({"seed": True}, "seed must be an integer, got True"),
])
def test_invalid_params(kw, message):
    with pytest.raises(SpecstackError) as e:
        SamplingParams(**kw)
    assert message in str(e.value)


def test_the_widest_seed_seeds_a_generator():
    for seed in (0, 2**64 - 1):
        assert make_generator(SamplingParams(temperature=1.0, seed=seed)) is not None


def test_sample_follows_the_probabilities_and_never_draws_a_zero():
    """The inverse-CDF sampler: counts fit the probabilities (chi-square, fixed seed, 1e-3 false-fail
    chance per row), a zero-probability token is never drawn (also next to one-hot rows at either
    end), unnormalised rows are fine, and a row without mass is an error."""
    from scipy.stats import chisquare

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],
                          [2e-2, 0.0, 0.0, 0.0, 0.0, 0.98],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],  # unnormalised one-hot at the end
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 20000
    draws = sample(probs.expand(n, 4, 6), torch.Generator().manual_seed(0))
    assert draws.shape == (n, 4)
    for row in range(4):
        counts = torch.bincount(draws[:, row], minlength=6).double()
        p = probs[row].double() / probs[row].sum()
        assert counts[p == 0].sum() == 0
        nz = p > 0
        if nz.sum() > 1:
            expected = p[nz] / p[nz].sum() * counts[nz].sum()
            assert chisquare(counts[nz].numpy(), expected.numpy()).pvalue > 1e-3
    with pytest.raises(ValueError, match="zero probability mass"):
        sample(torch.zeros(2, 6))


def test_seeded_sampling_is_reproducible():
    probs = warp(logits(4, 30, seed=5), SamplingParams(temperature=1.0))
    params = SamplingParams(temperature=1.0, seed=123)
    a = [sample(probs, make_generator(params)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    assert make_generator(SamplingParams(temperature=1.0)) is None
    g = make_generator(params)
    draws = torch.stack([sample(probs, g) for _ in range(20)])
    assert len({tuple(d.tolist()) for d in draws}) > 1  # the generator advances


def test_generate_with_a_seed_is_reproducible(tiny):
    prompt = [5, 17, 42, 99, 3, 250]
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False,
                           sampling=SamplingParams(temperature=1.0, top_k=50, seed=7))
    a = generate(tiny.lm, prompt, cfg)
    b = generate(tiny.lm, prompt, cfg)
    assert a.tokens == b.tokens and len(a.tokens) == 24
    other = generate(tiny.lm, prompt, GenerationConfig(max_new_tokens=24, stop_on_eos=False,
                                                       sampling=SamplingParams(temperature=1.0, top_k=50, seed=8)))
    assert other.tokens != a.tokens
    greedy = generate(tiny.lm, prompt, GenerationConfig(max_new_tokens=24, stop_on_eos=False))
    assert greedy.tokens != a.tokens  # sampling at temperature 1 does not collapse to greedy


def test_first_token_distribution_matches_warp(tiny_llama):
    """Chi-square goodness of fit of N first tokens drawn by the AR sampler (one seed per draw) against
    warp(target logits). The seeds are fixed, so the test is deterministic; with a correct sampler the
    p-value is uniform, and 1e-3 is the chance this particular seed set fails."""
    from scipy.stats import chisquare

    lm = tiny_llama.lm
    prompt = [7, 1, 200, 33, 33, 64]
    base = SamplingParams(temperature=1.3, top_k=12, top_p=0.95)
    model = lm.model
    p = warp(model.extend(torch.tensor([prompt]), model.new_cache(1)).logits[0, -1], base)
    support = torch.nonzero(p).flatten()
    assert 5 <= len(support) <= 12 and p.max() < 0.5  # a non-trivial distribution
    n = 3000
    counts = torch.zeros_like(p)
    for seed in range(n):
        params = SamplingParams(temperature=1.3, top_k=12, top_p=0.95, seed=seed)
        tok = generate(lm, prompt, GenerationConfig(max_new_tokens=1, stop_on_eos=False, sampling=params)).tokens
        counts[tok[0]] += 1
    assert counts.sum() == n
    assert counts[p == 0].sum() == 0, "sampled a token that the warp excludes"
    expected = p[support].double()
    stat, pvalue = chisquare(counts[support].double().numpy(), (n * expected / expected.sum()).numpy())
    assert pvalue > 1e-3, f"chi-square {stat:.1f}, p-value {pvalue:.2g}"


def nucleus_by_whole_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p's definition, each row sorted whole (descending, ties in index order): the drop mask."""
    drop = torch.ones_like(probs, dtype=torch.bool)
    for r, row in enumerate(probs):
        order = sorted(range(row.numel()), key=lambda i: (-float(row[i]), i))
        cum = row[order].cumsum(0)
        n_keep = min(int((cum < top_p).sum()) + 1, row.numel())
        drop[r, order[:n_keep]] = False
    return drop


def ragged_rows(seed: int, vocab: int) -> torch.Tensor:
    """Rows that exercise every way the candidates can end: peaked and flat rows, rows of equal values
    (ties across any candidate boundary), a row with a long zero tail (top-k before top-p)."""
    g = torch.Generator().manual_seed(seed)
    peaked = 8.0 * torch.randn(vocab, generator=g)
    flat = 0.05 * torch.randn(vocab, generator=g)
    steps = torch.randint(0, 4, (vocab,), generator=g).float()  # four values, thousands of ties each
    uniform = torch.zeros(vocab)
    cut = torch.randn(vocab, generator=g)
    cut[torch.randperm(vocab, generator=g)[: vocab - 7]] = float("-inf")
    return torch.softmax(torch.stack([peaked, flat, steps, uniform, cut]), -1)


@pytest.mark.parametrize("first", [4, 64, 1024])
@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5, 0.9, 0.999])
def test_top_p_from_candidates_equals_the_whole_sort(monkeypatch, first, top_p):
    """top-p looks at the largest probabilities first and sorts the whole vocabulary only when they cannot
    decide; whichever way it ends, it drops exactly what the definition drops."""
    from specstack import sampling

    monkeypatch.setattr(sampling, "_NUCLEUS_FIRST", first)
    for seed, vocab in [(0, 300), (1, 2000), (2, 5000)]:
        probs = ragged_rows(seed, vocab)
        expected = nucleus_by_whole_sort(probs, top_p)
        assert torch.equal(sampling.nucleus_drop(probs, top_p), expected), (seed, vocab)  # rows decided apart
        for r in range(len(probs)):
            assert torch.equal(sampling.nucleus_drop(probs[r], top_p), expected[r]), (seed, vocab, r)
    batched = ragged_rows(3, 2000).view(5, 1, 2000)  # any leading shape
    assert torch.equal(sampling.nucleus_drop(batched, top_p).view(5, 2000), nucleus_by_whole_sort(batched.view(5, 2000), top_p))


def test_top_p_after_top_k_never_sorts_the_vocabulary(monkeypatch):
    """Behind top-k every token past the k-th has probability 0: the candidates hold the whole nucleus,
    and the warp must not fall back to sorting a 150k vocabulary (its cost was most of a step)."""
    from specstack import sampling

    widths: list[int] = []
    descending = sampling._descending
    monkeypatch.setattr(sampling, "_descending", lambda flat, k: widths.append(k) or descending(flat, k))
    x = logits(4, 20000, seed=8, scale=0.01)  # flat: top-p alone would need most of the vocabulary
    for top_p in (0.999, 1 - 1e-9):  # the second is 1 in float32: the k tokens' mass may stay below it
        p = warp(x, SamplingParams(temperature=1.0, top_k=40, top_p=top_p))
        assert widths == [sampling._NUCLEUS_FIRST]
        assert ((p > 0).sum(-1) == 40).all()
        widths.clear()
    warp(x, SamplingParams(temperature=1.0, top_p=0.999))
    assert widths[-1] == 20000  # and the flat row alone does sort it (the spy sees every width)
