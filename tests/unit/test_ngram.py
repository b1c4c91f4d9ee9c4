"""draft2: the Katz backoff trigram, the context lookup, the n-gram drafter and `specstack ngram train`."""
from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import specstack.cli.entry
from specstack.config import SamplingParams
from specstack.drafting.base import DraftContext
from specstack.drafting.katz import KatzTrigram
from specstack.drafting.katz_estimate import good_turing_discounts
from specstack.drafting.lookup import ContextLookup
from specstack.drafting.ngram import STAGED_WIDTHS, NgramDrafter
from specstack.models.registry import default_ngram_path
from specstack.verify import VerifyResult

# ---------------------------------------------------------------------------------------------------
# A hand-worked corpus (vocabulary 0..5, k = 2)
# ---------------------------------------------------------------------------------------------------
# Three-token streams contribute exactly one trigram each: 8 trigrams seen once, 3 twice, 1 three times.
ONCE = [(0, 1, 2), (0, 1, 3), (0, 1, 4), (1, 2, 3), (2, 3, 4), (3, 4, 5), (4, 5, 0), (5, 0, 1)]
TWICE = [(0, 1, 5), (1, 2, 0), (2, 3, 1)]
THRICE = [(3, 4, 0)]
# Two-token streams add 15 bigrams seen once (none of them new continuations of token 1).
PAIRS = [(0, 0), (0, 2), (0, 3), (0, 4), (0, 5), (4, 1), (4, 2), (2, 1), (2, 2), (2, 4), (2, 5),
         (3, 0), (3, 2), (3, 3), (3, 5)]
HAND_STREAMS = [list(t) for t in ONCE] + [list(t) for t in TWICE for _ in range(2)] \
    + [list(t) for t in THRICE for _ in range(3)] + [list(p) for p in PAIRS]
V_HAND = 6


@pytest.fixture(scope="module")
def hand() -> KatzTrigram:
    return KatzTrigram.train(HAND_STREAMS, V_HAND, k=2)


def test_hand_counts_are_what_the_test_assumes() -> None:
    tri = Counter(tuple(s[i:i + 3]) for s in HAND_STREAMS for i in range(len(s) - 2))
    bi = Counter(tuple(s[i:i + 2]) for s in HAND_STREAMS for i in range(len(s) - 1))
    assert Counter(tri.values()) == {1: 8, 2: 3, 3: 1}
    # bigrams: 13, 14 and the 15 pairs once; 45, 50, 15, 20, 31 twice; 40 three times; more: 12, 23, 34, 01
    assert Counter(bi.values()) == {1: 17, 2: 5, 3: 1, 4: 2, 5: 1, 6: 1}
    assert {w: c for (v, w), c in bi.items() if v == 1} == {2: 4, 3: 1, 4: 1, 5: 2}
    assert {w: c for (u, v, w), c in tri.items() if (u, v) == (0, 1)} == {2: 1, 3: 1, 4: 1, 5: 2}


def test_hand_worked_discounts_and_backoff(hand: KatzTrigram) -> None:
    # trigram level: n1 = 8, n2 = 3, n3 = 1, k = 2
    A3 = 3 * 1 / 8  # (k+1) n_{k+1} / n_1 = 0.375
    d3 = [(2 * 3 / (1 * 8) - A3) / (1 - A3), (3 * 1 / (2 * 3) - A3) / (1 - A3)]  # 0.6, 0.2
    assert d3 == pytest.approx([0.6, 0.2])
    assert hand.meta["A"]["trigram"] == pytest.approx(A3)
    assert hand.discounts["trigram"] == pytest.approx(d3)
    # bigram level: n1 = 17, n2 = 5, n3 = 1
    A2 = 3 * 1 / 17
    d2 = [(2 * 5 / 17 - A2) / (1 - A2), (3 * 1 / (2 * 5) - A2) / (1 - A2)]  # 0.5, 0.15
    assert d2 == pytest.approx([0.5, 0.15])
    assert hand.meta["A"]["bigram"] == pytest.approx(A2)
    assert hand.discounts["bigram"] == pytest.approx(d2)

    # unigram: every token seen, so the plain relative frequency
    uni = Counter(t for s in HAND_STREAMS for t in s)
    N = sum(uni.values())
    p_uni = {w: uni[w] / N for w in range(V_HAND)}
    assert hand.prob(3, []) == pytest.approx(p_uni[3], rel=1e-6)

    # bigram context 1: c(12) = 4 (> k, undiscounted), c(13) = c(14) = 1, c(15) = 2; c(1) = 8
    p_bi1 = {2: 4 / 8, 3: d2[0] * 1 / 8, 4: d2[0] * 1 / 8, 5: d2[1] * 2 / 8}
    alpha1 = (1 - sum(p_bi1.values())) / (1 - sum(p_uni[w] for w in p_bi1))
    p_bi1.update({w: alpha1 * p_uni[w] for w in (0, 1)})
    assert hand.backoff_weight([1]) == pytest.approx(alpha1, rel=1e-6)
    for w in range(V_HAND):
        assert hand.prob(w, [1]) == pytest.approx(p_bi1[w], rel=1e-6)

    # trigram context (0, 1): c(012) = c(013) = c(014) = 1, c(015) = 2; c(01) = 5
    p_tri = {2: d3[0] / 5, 3: d3[0] / 5, 4: d3[0] / 5, 5: d3[1] * 2 / 5}  # 0.12, 0.12, 0.12, 0.08
    alpha01 = (1 - sum(p_tri.values())) / (1 - sum(p_bi1[w] for w in p_tri))  # 0.56 / 0.3375
    assert alpha01 == pytest.approx(0.56 / 0.3375)
    assert hand.backoff_weight([0, 1]) == pytest.approx(alpha01, rel=1e-6)
    p_tri.update({w: alpha01 * p_bi1[w] for w in (0, 1)})
    dist = hand.distribution([0, 1])
    for w in range(V_HAND):
        assert hand.prob(w, [0, 1]) == pytest.approx(p_tri[w], rel=1e-6)
        assert float(dist[w]) == pytest.approx(p_tri[w], rel=1e-5)
    assert sum(p_tri.values()) == pytest.approx(1.0)


def test_discount_fallbacks() -> None:
    d, A = good_turing_discounts([0, 2, 5, 1], k=2)  # A = 3 * 1 / 2 >= 1: no discounting
    assert A == 1.5 and d[1:].tolist() == [1.0, 1.0]
    d, A = good_turing_discounts([0, 6, 5, 1], k=2)  # A = 0.5; d1 = 2.33 > 1, d2 = -0.4 < 0: both 1
    assert A == 0.5 and d[1:].tolist() == [1.0, 1.0]
    d, A = good_turing_discounts([0, 8, 3, 1], k=2)
    assert d[1:].tolist() == pytest.approx([0.6, 0.2])
    d, _ = good_turing_discounts([0, 0, 3], k=2)  # no singletons: no discounts
    assert d[1:].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------------
# A proper distribution, on random corpora (pruned or not) and on the shipped model
# ---------------------------------------------------------------------------------------------------
def _random_streams(V: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.4, size=int(rng.integers(3, 200))).clip(1, V) - 1).tolist() for _ in range(60)]


def _check_proper(m: KatzTrigram, contexts: list[list[int]], tokens: list[int]) -> None:
    for ctx in contexts:
        d = m.distribution(ctx)
        assert d.dtype == torch.float32 and d.shape == (m.vocab_size,)
        assert abs(float(d.double().sum()) - 1.0) < 1e-5, ctx
        assert float(d.min()) >= 0.0
        for w in tokens:
            assert m.prob(w, ctx) == pytest.approx(float(d[w]), rel=1e-5, abs=1e-9), (ctx, w)
        top = m.top(ctx, 12)
        probs = [p for _, p in top]
        assert probs == sorted(probs, reverse=True)
        for t, p in top:
            assert p == pytest.approx(float(d[t]), rel=1e-5, abs=1e-9)
        rest = d.clone()
        rest[[t for t, _ in top]] = -1
        assert float(rest.max()) <= probs[-1] * (1 + 1e-5), ctx  # nothing left out beats the n-th


@pytest.mark.parametrize("min_count", [1, 2, 4])
def test_random_corpus_is_normalised(min_count: int) -> None:
    V = 60
    m = KatzTrigram.train(_random_streams(V), V, k=5, min_count=min_count)
    assert (m.distribution([]) > 0).all()  # the unigram gives every token mass
    contexts = [[], [0], [59], [0, 0], [1, 0], [0, 1], [2, 3], [58, 59], [7, 7, 7]]
    _check_proper(m, contexts, list(range(V)))


@pytest.fixture(scope="module")
def shipped() -> KatzTrigram:
    path = default_ngram_path("smollm2-135m")
    assert path is not None and path.is_file()
    return KatzTrigram.load(path)


def test_shipped_model_loads_fast_and_is_small() -> None:
    path = default_ngram_path("smollm2-135m")
    assert path.stat().st_size <= 8_500_000
    t = time.perf_counter()
    m = KatzTrigram.load(path)
    assert time.perf_counter() - t < 1.0
    assert m.vocab_size == 49152
    assert default_ngram_path("no-such-model") is None


def test_shipped_model_is_normalised(shipped: KatzTrigram) -> None:
    m, V = shipped, shipped.vocab_size
    tri_key = int(m.trigram.ctx[len(m.trigram.ctx) // 2])
    seen_tri = [tri_key // V, tri_key % V]
    v = int(m.bigram.ctx[len(m.bigram.ctx) // 3])
    u = next(u for u in range(V) if u * V + v not in m._tri_row)
    unseen = int(np.flatnonzero(m.unigram == m.unigram.min())[0])  # a token never seen in the corpus
    contexts = [seen_tri, [u, v], [unseen, unseen], [unseen], []]
    assert m.backoff_weight([u, v]) == 1.0 and m.backoff_weight(seen_tri) < 1.0
    rng = random.Random(0)
    tokens = sorted({t for ctx in contexts for t, _ in m.top(ctx, 5)} | {rng.randrange(V) for _ in range(20)})
    _check_proper(m, contexts, tokens)


def test_save_load_round_trip(tmp_path: Path) -> None:
    V = 40
    m = KatzTrigram.train(_random_streams(V, seed=3), V, k=4, min_count=2, min_count_bigram=1)
    path = m.save(tmp_path / "m.npz")
    m2 = KatzTrigram.load(path)
    assert (m2.vocab_size, m2.k) == (m.vocab_size, m.k)
    assert m2.meta["discounts"] == m.meta["discounts"] and m2.meta["kept"] == m.meta["kept"]
    for ctx in ([], [0], [0, 0], [3, 1], [39, 39]):
        assert torch.allclose(m.distribution(ctx), m2.distribution(ctx), rtol=1e-6, atol=1e-9)
        top, top2 = m.top(ctx, 8), m2.top(ctx, 8)
        assert [t for t, _ in top] == [t for t, _ in top2]  # the same tokens in the same order
        assert [p for _, p in top] == pytest.approx([p for _, p in top2])
    assert not list(tmp_path.glob("*.tmp"))


def test_train_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        KatzTrigram.train([[0, 1, 7]], vocab_size=5)
    with pytest.raises(ValueError):
        KatzTrigram.train([[0, 1]], vocab_size=5, k=0)
    empty = KatzTrigram.train([], vocab_size=5)  # no data: uniform
    assert torch.allclose(empty.distribution([1, 2]), torch.full((5,), 0.2))


# ---------------------------------------------------------------------------------------------------
# Context lookup
# ---------------------------------------------------------------------------------------------------
def test_context_lookup_finds_most_recent_continuation() -> None:
    lk = ContextLookup(max_n=3)
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    lk.reset(seq)
    # suffix (2, 3): occurrences followed by 4 (pos 4) and 5 (pos 8); most recent first; the
    # trigram (7, 2, 3) never occurred before, so the best match has n = 2
    assert lk.matches(limit=2) == [(2, 8), (2, 3)]
    assert lk.continuation(4) == (2, [5, 6, 7, 2])
    assert lk.next_tokens(3) == [5, 4]  # the 1-gram (3,) was also followed only by 5 and 4
    lk.attach(seq + [1, 2, 3])  # now (1, 2, 3) matches: most recent is followed by 5
    assert lk.continuation(3) == (3, [5, 6, 7])
    assert lk.matches(limit=1) == [(3, 8)]


def test_context_lookup_prefers_longer_matches() -> None:
    lk = ContextLookup(max_n=3)
    lk.reset([7, 8, 9, 1, 0, 8, 9, 2, 0, 9, 3, 7, 8, 9])
    # (7, 8, 9) occurred once, followed by 1; (8, 9) more recently followed by 2; (9,) by 3
    assert lk.continuation(1) == (3, [1])
    assert lk.next_tokens(3) == [1, 2, 3]
    assert lk.next_tokens(3, min_n=2) == [1, 2]


def test_context_lookup_attach_rolls_back_like_a_fresh_index() -> None:
    rng = random.Random(1)
    lk = ContextLookup(max_n=3, keep=10_000)
    base = [rng.randrange(5) for _ in range(300)]
    lk.reset(base)
    for _ in range(30):  # the staged pattern: committed prefix + a changing speculative tail
        cut = len(base) - rng.randrange(0, 6)
        seq = base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
        lk.attach(seq)
        fresh = ContextLookup(max_n=3, keep=10_000)
        fresh.reset(seq)
        assert lk.tokens == seq and lk._index == fresh._index
        base = seq if rng.random() < 0.5 else base
    lk.attach([4, 4, 4])  # a different sequence
    assert lk.tokens == [4, 4, 4] and lk.continuation(5) == (2, [4])


# ---------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------
def _check_shape(tree, widths) -> None:
    levels: dict[int, list[int]] = {}
    for i, d in enumerate(tree.depth):  # depth 1 = children of the root
        levels.setdefault(d - 1, []).append(i)
    assert sorted(levels) == list(range(len(levels)))
    for d, ids in levels.items():
        assert len(ids) <= widths[d]
        parents = {tree.parent[i] for i in ids}
        assert parents == ({-1} if d == 0 else {levels[d - 1][0]})  # children of the level's best node
        toks = [tree.tokens[i] for i in ids]
        assert len(set(toks)) == len(toks)  # no duplicate siblings
        origins = [tree.origin[i] for i in ids]
        assert set(origins) <= {"context", "draft2"}
        n_ctx = origins.count("context")
        assert origins == ["context"] * n_ctx + ["draft2"] * (len(origins) - n_ctx)  # context first
    for i, p in enumerate(tree.parent):
        assert p < i  # prefix-closed, topological
    assert all(q is None for q in tree.q)


def test_proposal_tree_shape_and_spine(shipped: KatzTrigram) -> None:
    drafter = NgramDrafter(shipped)
    ctx = [100, 200, 300, 400, 500, 600, 700, 800, 5, 6, 7, 200, 300]
    tree = drafter.proposal_tree(ctx, STAGED_WIDTHS)
    _check_shape(tree, STAGED_WIDTHS)
    assert [tree.depth.count(k) for k in range(1, 7)] == [12, 7, 4, 1, 1, 1]
    # the context match (200, 300) -> 400 500 600 ... is the spine
    spine = [tree.tokens[i] for i in tree.paths()[-1]]
    assert spine == [400, 500, 600, 700, 800, 5]
    assert tree.origin[0] == "context"
    assert drafter.lookup.tokens == ctx  # proposing leaves the index on the context
    # no match: the trigram alone, its top tokens in order
    lone = NgramDrafter(shipped)
    tree = lone.proposal_tree([1234, 4321], (5, 2))
    _check_shape(tree, (5, 2))
    assert tree.origin == ["draft2"] * 7
    assert tree.tokens[:5] == [t for t, _ in shipped.top([1234, 4321], 5)]
    # context only (no trigram) still works; widths are respected
    tree = NgramDrafter(None).proposal_tree(ctx, (3, 1))
    _check_shape(tree, (3, 1))
    assert set(tree.origin) == {"context"}


def test_drafter_protocol_and_latency(shipped: KatzTrigram) -> None:
    rng = random.Random(2)
    drafter = NgramDrafter(shipped)
    prompt = [rng.randrange(2000) for _ in range(400)]
    drafter.reset(prompt)
    ctx = DraftContext(list(prompt), SamplingParams())
    times = []
    for _ in range(60):
        t = time.perf_counter()
        tree = drafter.propose(ctx)
        times.append(time.perf_counter() - t)
        _check_shape(tree, STAGED_WIDTHS)
        assert len(tree) <= sum(STAGED_WIDTHS)
        accepted = tree.path_to(0)
        result = VerifyResult(accepted, [tree.tokens[i] for i in accepted] + [rng.randrange(2000)])
        drafter.observe(tree, result)
        ctx.tokens.extend(result.tokens)
    assert drafter.lookup.tokens == ctx.tokens[:-len(result.tokens)]
    assert sorted(times)[len(times) // 2] < 1e-3  # median proposal well under a millisecond


# ---------------------------------------------------------------------------------------------------
# `specstack ngram train`
# ---------------------------------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = specstack.cli.entry.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_train_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "skipme").mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    (corpus / "pkg" / "b.py").write_text("for i in range(10):\n    print(i)\n" * 3)
    (corpus / "skipme" / "c.py").write_text("never read\n")
    (corpus / "notes.txt").write_text("not python")
    out_file = tmp_path / "m.npz"
    code, out, err = _cli(capsys, "ngram", "train", "--corpus", str(corpus), "--out", str(out_file),
                          "--k", "3", "--exclude-dir", "skipme")
    assert code == 0, err
    assert "2 files" in out and "trigrams" in out and "saved" in out
    m = KatzTrigram.load(out_file)
    assert m.vocab_size == 49152 and m.k == 3 and m.meta["streams"] == 2
    assert abs(float(m.distribution([]).sum()) - 1) < 1e-5


@pytest.mark.parametrize("argv,phrase", [
    (["--corpus", "/no/such/path"], "corpus path not found"),
    (["--corpus", "{empty}"], "no corpus files"),
    (["--corpus", "{blank}"], "empty"),
    (["--corpus", "{blank}", "--model", "no-such-model"], "unknown model"),
    (["--corpus", "{blank}", "--min-count", "0"], "min-count"),
])
def test_cli_train_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], phrase: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.py").write_text("\n\n   \n")
    argv = [a.format(empty=tmp_path / "empty", blank=tmp_path / "blank.py") for a in argv]
    code, out, err = _cli(capsys, "ngram", "train", "--out", str(tmp_path / "x.npz"), *argv)
    assert code == 2
    assert err.startswith("specstack: error: ") and err.count("\n") == 1 and phrase in err, err
    assert not (tmp_path / "x.npz").exists()


def test_bad_model_files_are_clean_errors(tmp_path: Path) -> None:
    from specstack.errors import SpecstackError

    with pytest.raises(SpecstackError, match="not found"):
        KatzTrigram.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(SpecstackError, match="cannot read"):
        KatzTrigram.load(tmp_path / "junk.npz")
    m = KatzTrigram.train([[0, 1, 2]], vocab_size=5)
    m.check_vocab(5)
    with pytest.raises(SpecstackError, match="5 tokens"):
        m.check_vocab(49152)


def test_a_chain_cut_by_the_batch_still_teaches_its_length_rule() -> None:
    """A batch's length rule may verify none of a row's proposed chain; the emitted token still says
    whether the chain's first token was right (a deterministic proposal is accepted exactly when it
    equals the target's token): the drafter's next propose tells the rule (ctx.lessons), whose rates learn."""
    from specstack.drafting.batch_length import CostAwareLength
    from specstack.tree import DraftTree

    rule = CostAwareLength(lambda rows, tokens: 1.0 + 0.01 * (tokens - 1), longest=4)
    drafter = NgramDrafter(None, widths=(1,) * 8, max_n=4)
    context = [5, 6, 7, 8, 9, 5, 6, 7]  # the context lookup proposes 8, 9, 5, 6
    drafter.reset(context)
    ctx = DraftContext(list(context), SamplingParams(), limit=rule.limit())
    tree = drafter.propose(ctx)
    assert tree.tokens == [8, 9, 5, 6]  # up to the rule's limit
    cls = ("context", 3, 1)  # its first token's evidence: a match of the last 3 tokens, depth 1
    assert tree.evidence[0] == cls and ctx.lessons == []
    before = rule.rates.p(cls)
    rule.observe([DraftTree()], [0])  # cut to nothing: the verified tree says nothing
    drafter.observe(DraftTree(), VerifyResult([], [8]))  # the target's token was 8: right
    ctx = DraftContext(context + [8], SamplingParams(), limit=rule.limit())
    tree = drafter.propose(ctx)
    assert ctx.lessons == [(cls, True)]
    rule.learn(ctx.take_lessons())
    assert rule.rates.p(cls) > before and ctx.lessons == []
    mid = rule.rates.p(("context", 4, 1))
    drafter.observe(DraftTree(), VerifyResult([], [tree.tokens[0] + 1]))  # wrong
    ctx = DraftContext(context + [8, tree.tokens[0] + 1], SamplingParams())
    drafter.propose(ctx)
    rule.learn(ctx.lessons)
    assert rule.rates.p(("context", 4, 1)) < mid
    # a chain verified past the cut, or not accepted up to it, teaches nothing more than its verdict
    drafter.observe(tree.truncated(2), VerifyResult([0], [tree.tokens[0], 1]))
    ctx = DraftContext(context, SamplingParams())
    drafter.propose(ctx)
    assert ctx.lessons == []
