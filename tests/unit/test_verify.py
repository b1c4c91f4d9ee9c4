"""Hand-worked verification cases (DESIGN §5): the pure verifiers on small trees with chosen target
rows, where the outcome can be worked out on paper. Convention (verify.py): p row 0 is the target at
the root, row i + 1 the target after node i."""
from __future__ import annotations

import math
import random

import pytest
import torch

from specstack.config import SamplingParams
from specstack.sampling import argmax_rows
from specstack.tree import DraftTree
from specstack.verify import verify_greedy, verify_rrs, verify_sample_walk, walk_greedy
from specstack.verify import verify_tree as verify

V = 8


def one_hot_logits(argmaxes: list[int], v: int = V) -> torch.Tensor:
    """Rows of logits whose argmax is the given token (other entries distinct, so no ties)."""
    rows = torch.linspace(-1.0, 0.0, v).repeat(len(argmaxes), 1)
    for r, a in enumerate(argmaxes):
        rows[r, a] = 3.0
    return rows


def one_hot(tokens: list[int], v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), v).float()


def example_tree(q: list[torch.Tensor | None] | None = None) -> DraftTree:
    """      root
           /      \\
       n0:3        n1:1
       /   \\         |
    n2:2  n3:4      n4:0
                      |
                    n5:6
    """
    return DraftTree([3, 1, 2, 4, 0, 6], [-1, -1, 0, 0, 1, 4], q=q or [])


# -- greedy ---------------------------------------------------------------------------------------
def test_greedy_accepts_a_path_to_a_leaf_and_adds_the_bonus():
    tree = example_tree()
    # rows: root, after n0..n5. root -> 3 (n0), after n0 -> 4 (n3, a leaf), after n3 -> bonus 7
    logits = one_hot_logits([3, 4, 0, 0, 7, 0, 0])
    r = verify_greedy(tree, logits)
    assert r.accepted == [0, 3]
    assert r.tokens == [3, 4, 7]
    assert r.next_token == 7


def test_greedy_deep_leaf_bonus():
    tree = example_tree()
    # root -> 1 (n1), after n1 -> 0 (n4), after n4 -> 6 (n5, a leaf), after n5 -> bonus 5
    logits = one_hot_logits([1, 0, 0, 0, 0, 6, 5])
    r = verify_greedy(tree, logits)
    assert r.accepted == [1, 4, 5]
    assert r.tokens == [1, 0, 6, 5]


def test_greedy_correction_where_no_child_matches():
    tree = example_tree()
    # root -> 3 (n0), after n0 -> 5: neither child (2, 4) matches, so 5 is the correction
    r = verify_greedy(tree, one_hot_logits([3, 5, 2, 2, 2, 2, 2]))
    assert r.accepted == [0]
    assert r.tokens == [3, 5]
    # root -> 6: nothing accepted, the correction alone is emitted
    r = verify_greedy(tree, one_hot_logits([6, 4, 2, 2, 2, 2, 2]))
    assert r.accepted == [] and r.tokens == [6]


def test_greedy_empty_tree_emits_the_argmax():
    r = verify_greedy(DraftTree(), one_hot_logits([5]))
    assert r.accepted == [] and r.tokens == [5]


def test_greedy_duplicate_sibling_tokens_take_the_first():
    # two root children with the same token 3; only the second has a child (4)
    tree = DraftTree([3, 3, 4], [-1, -1, 1])
    logits = one_hot_logits([3, 4, 4, 1])  # rows: root, after n0, after n1, after n2
    r = verify_greedy(tree, logits)
    # the first sibling wins; its row (after n0) says 4, which n0 has no child for: correction 4.
    # The emitted tokens are the target's greedy continuation either way.
    assert r.accepted == [0]
    assert r.tokens == [3, 4]


def test_greedy_uses_first_index_on_ties():
    tree = DraftTree([2, 5], [-1, -1])
    logits = torch.zeros(3, V)
    logits[0, 2] = logits[0, 5] = 1.0  # a tie: argmax picks 2, like the autoregressive sampler
    r = verify_greedy(tree, logits)
    assert r.accepted == [0] and r.tokens == [2, 0]


def test_greedy_emits_exactly_the_targets_argmax_chain_on_random_trees():
    """Property: whatever the tree, the emitted tokens are the argmax of the row reached so far, the
    accepted nodes form a root-to-node path whose tokens are the emitted prefix, and the walk stops
    only where no child carries the argmax."""
    rnd = random.Random(0)
    for trial in range(200):
        n = rnd.randint(0, 12)
        parents = [rnd.randint(-1, i - 1) for i in range(n)]
        tokens = [rnd.randrange(4) for _ in range(n)]  # small alphabet: many matches and duplicates
        tree = DraftTree(tokens, parents)
        logits = torch.randn(n + 1, 4, generator=torch.Generator().manual_seed(trial))
        r = verify_greedy(tree, logits)
        node = -1
        for j, tok in enumerate(r.tokens):
            assert tok == int(logits[node + 1].argmax())
            if j < len(r.accepted):
                nxt = r.accepted[j]
                assert tree.parent[nxt] == node and tree.tokens[nxt] == tok
                node = nxt
        assert len(r.tokens) == len(r.accepted) + 1
        assert all(tree.tokens[c] != r.tokens[-1] for c in tree.children(node))


def test_a_batch_walks_its_trees_along_one_argmax_as_each_alone():
    """The engine's greedy rows walk their trees along one argmax of the whole forward's rows (ragged:
    each row's slice at its offset): the same verdicts as verify_greedy on each row alone, ties (small
    integer logits) and duplicate siblings included."""
    rnd = random.Random(1)
    for trial in range(50):
        trees = []
        for _ in range(rnd.randint(1, 8)):
            n = rnd.randint(0, 10)
            trees.append(DraftTree([rnd.randrange(4) for _ in range(n)], [rnd.randint(-1, i - 1) for i in range(n)]))
        g = torch.Generator().manual_seed(trial)
        rows = [torch.randint(0, 3, (len(t) + 1, 4), generator=g).float() for t in trees]
        best = torch.cat(rows).argmax(-1).tolist()
        at = 0
        for tree, logits in zip(trees, rows, strict=True):
            assert walk_greedy(tree, best[at : at + len(logits)]) == verify_greedy(tree, logits)
            at += len(logits)


# -- sample-walk ----------------------------------------------------------------------------------
def test_sample_walk_with_one_hot_rows_is_deterministic():
    tree = example_tree()
    g = torch.Generator().manual_seed(0)
    p = one_hot([1, 2, 0, 2, 2, 6, 5])  # root -> 1 (n1) -> 0 (n4) -> 6 (n5) -> bonus 5
    for _ in range(5):
        r = verify_sample_walk(tree, p, g)
        assert r.accepted == [1, 4, 5] and r.tokens == [1, 0, 6, 5]
    p = one_hot([3, 7, 0, 0, 0, 0, 0])  # root -> 3 (n0) -> 7: not a child of n0
    r = verify_sample_walk(tree, p, g)
    assert r.accepted == [0] and r.tokens == [3, 7]


def test_sample_walk_ignores_rows_of_nodes_off_the_path():
    tree = example_tree()
    p = one_hot([3, 2, 0, 0, 0, 0, 0])
    p[2:] = float("nan")  # rows of n1.. must never be read on the path root -> n0 -> n2 (leaf)
    p[3] = one_hot([5])[0]  # row after n2 (the leaf) gives the bonus
    r = verify_sample_walk(tree, p, torch.Generator().manual_seed(1))
    assert r.accepted == [0, 2] and r.tokens == [3, 2, 5]


# -- recursive rejection sampling -----------------------------------------------------------------
def _q(*vals: float) -> torch.Tensor:
    q = torch.tensor(vals + (0.0,) * (V - len(vals)))
    return q / q.sum()


def test_rrs_one_hot_target_on_a_child_always_accepts_it():
    q_root = _q(0.1, 0.3, 0.2, 0.4)  # children 3 then 1 drawn from q_root; p at root is one-hot 1
    q_n0 = _q(0.5, 0.0, 0.25, 0.0, 0.25)
    q_n1 = _q(1.0)
    tree = example_tree([q_root, q_root, q_n0, q_n0, q_n1, _q(1, 1, 1, 1, 1, 1, 1, 1)])
    p = one_hot([1, 0, 0, 0, 0, 6, 2])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        r = verify_rrs(tree, p, g)
        # n0 (token 3) has p = 0: rejected; the residual is one-hot at 1, so n1 is accepted; then
        # n4 (token 0, q = 1, p = 1) and n5 (token 6) are accepted; the bonus is 2
        assert r.accepted == [1, 4, 5]
        assert r.tokens == [1, 0, 6, 2]


def test_rrs_one_hot_target_off_the_children_emits_that_token():
    q_root = _q(0.1, 0.3, 0.2, 0.4)
    tree = DraftTree([3, 1, 0], [-1, -1, -1], q=[q_root] * 3)
    p = one_hot([5, 0, 0, 0])  # no child has p > 0: all are rejected, the residual is one-hot 5
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        r = verify_rrs(tree, p, g)
        assert r.accepted == [] and r.tokens == [5]


def test_rrs_with_p_equal_q_accepts_the_whole_chain():
    rows = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3)), -1)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        toks = [int(torch.multinomial(rows[i], 1, generator=g)) for i in range(3)]
        tree = DraftTree(toks, [-1, 0, 1], q=[rows[0], rows[1], rows[2]])
        r = verify_rrs(tree, rows, g)
        assert r.accepted == [0, 1, 2]
        assert r.tokens[:3] == toks


@pytest.mark.parametrize("px, qx", [(0.12, 0.2), (0.3, 0.5), (0.5, 0.25)])
def test_rrs_single_child_is_the_classic_rule(px, qx):
    """A chain of one child: accepted with probability min(1, p(x)/q(x)); on rejection the emitted
    token is drawn from norm(max(p - q, 0)), never x itself."""
    x = 2
    p = torch.full((V,), (1 - px) / (V - 1))
    p[x] = px
    q = torch.zeros(V)
    q[x] = qx
    q[[0, 1, 5]] = (1 - qx) / 3
    tree = DraftTree([x], [-1], q=[q])
    rows = torch.stack([p, torch.full((V,), 1.0 / V)])
    n = 4000
    g = torch.Generator().manual_seed(12345)
    accepted = 0
    residual_support = (p - q).clamp(min=0) > 0
    for _ in range(n):
        r = verify_rrs(tree, rows, g)
        if r.accepted:
            accepted += 1
        else:
            assert residual_support[r.tokens[0]], r.tokens
    a = min(1.0, px / qx)
    # 4.9 standard deviations: a false failure has probability about 1e-6
    tol = 4.9 * math.sqrt(max(a * (1 - a), 1e-12) / n)
    assert abs(accepted / n - a) <= tol, (accepted / n, a)


# -- dispatch -------------------------------------------------------------------------------------
def test_engine_verify_dispatches_on_sampling_and_q():
    """Greedy -> argmax walk; sampling with q on every node -> RRS; otherwise sample-walk. Two
    children a, b with p = q = uniform over {a, b}: RRS accepts the first child every time (ratio 1),
    sample-walk follows a draw from p and takes the second child about half of the time."""
    a, b = 4, 6
    logits = torch.full((3, V), -40.0)
    logits[0, [a, b]] = 0.0
    logits[1:, 1] = 0.0
    q = _q(*[1.0 if t in (a, b) else 0.0 for t in range(V)])
    tree_q = DraftTree([a, b], [-1, -1], q=[q, q])
    tree_det = DraftTree([a, b], [-1, -1])
    g = torch.Generator().manual_seed(0)
    sampling = SamplingParams(temperature=1.0)
    assert verify(tree_det, logits, SamplingParams(), None).tokens == [a, 1]  # argmax, first on ties
    rrs = [verify(tree_q, logits, sampling, g).accepted for _ in range(100)]
    walk = [verify(tree_det, logits, sampling, g).accepted for _ in range(100)]
    assert all(acc == [0] for acc in rrs)
    assert all(acc in ([0], [1]) for acc in walk) and 20 <= sum(acc == [1] for acc in walk) <= 80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax_ties_and_nans_included(dtype):
    """The greedy walk's argmax (NumPy's on the CPU) picks what torch's argmax picks: the first index on
    ties, a NaN above every number, in fp32 and in bf16 (whose coarse values tie often)."""
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 3, 40):
        logits = (torch.randn(rows, 4099, generator=gen) * 4).round().to(dtype)  # rounded: many ties
        logits[0, 17] = logits[0, 4000] = logits[0].max() + 1  # a tie for the maximum, far apart
        if rows > 1:
            logits[1, 9] = float("nan")
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
        assert argmax_rows(logits)[0] == 17
        assert argmax_rows(logits.float().requires_grad_()) == logits.argmax(-1).tolist()  # a tensor with grad


# -- the target's rows warped as the walk reaches them ---------------------------------------------
SETTINGS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=20),
            SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=50, top_p=0.95)]


@pytest.mark.parametrize("sampling", SETTINGS)
def test_a_row_warped_alone_is_the_row_warped_in_its_batch(sampling):
    from specstack.sampling import warp

    x = 3 * torch.randn(9, 3000, generator=torch.Generator().manual_seed(4))
    together = warp(x, sampling)
    for i in range(len(x)):
        assert torch.equal(warp(x[i], sampling), together[i])


def random_sampled_tree(rng: random.Random, vocab: int, with_q: bool) -> DraftTree:
    """A random tree of up to 12 nodes: tokens at random (distinct siblings), siblings sharing one q."""
    tokens: list[int] = []
    parent: list[int] = []
    qs: list[torch.Tensor | None] = []
    for _ in range(rng.randint(0, 12)):
        par = rng.randint(-1, len(tokens) - 1)
        q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randint(0, 10**6))), -1)
        siblings = {tokens[i] for i in range(len(tokens)) if parent[i] == par}
        tok = rng.choice([t for t in range(vocab) if t not in siblings])
        tokens.append(tok)
        parent.append(par)
        qs.append(q if with_q else None)
    # siblings share their parent's q (children are drawn from one distribution)
    for i, par in enumerate(parent):
        first = parent.index(par)
        qs[i] = qs[first]
    return DraftTree(tokens, parent, q=qs if with_q else [])


@pytest.mark.parametrize("sampling", SETTINGS)
def test_rows_warped_on_demand_give_the_verdicts_of_the_whole_warp(monkeypatch, sampling):
    """verify_tree warps a row when the walk reaches it: the same seeded verdicts as verifying the whole
    warped block, and no more rows warped than the walk read (its accepted path and the stop)."""
    from specstack import sampling as sampling_module
    from specstack import verify as verify_module

    rng = random.Random(7)
    vocab = 40
    warped: list[int] = []
    real_warp = sampling_module.warp
    monkeypatch.setattr(verify_module, "warp", lambda x, s: warped.append(x.shape[0] if x.dim() > 1 else 1) or real_warp(x, s))
    for case in range(60):
        tree = random_sampled_tree(rng, vocab, with_q=case % 2 == 0)
        logits = 2 * torch.randn(1 + len(tree), vocab, generator=torch.Generator().manual_seed(case))
        warped.clear()
        lazy = verify(tree, logits, sampling, torch.Generator().manual_seed(case))
        assert sum(warped) <= len(lazy.accepted) + 1
        whole = real_warp(logits, sampling)
        pure = verify_rrs if case % 2 == 0 and len(tree) else verify_sample_walk
        assert lazy == pure(tree, whole, torch.Generator().manual_seed(case)), case
