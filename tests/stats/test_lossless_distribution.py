"""Empirical distribution tests of the sampling verifiers (DESIGN §2.1, §5), the method vLLM uses for
its rejection sampler: many seeded runs on a small vocabulary, chi-square goodness of fit against the
exact target distribution.

A toy "model" maps a context (tuple of tokens) to logits; the target's p and the draft's q both go
through `warp` (the one warp). A 2-step mini loop of verify calls emits tokens: draft a tree off the
context, score every node with the target, verify, append the emitted tokens, repeat until two tokens
are out. Lossless means the first emitted token follows p(. | ctx) and the pair follows
p(x1 | ctx) p(x2 | ctx + x1), whatever the tree.

Significance: every test makes a few chi-square checks whose p-value thresholds add up to 1e-4, so a
correct verifier fails a test with probability about 1e-4 per seed set; the seeds are fixed, so each
run is deterministic. Deliberately broken verifiers (no residual update in RRS, the wrong row of p, a
sample-walk that trusts the draft) fail these tests by many orders of magnitude.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from chisq import chi2_pvalue

from specstack.config import SamplingParams
from specstack.drafting.candidates import children_of
from specstack.sampling import warp
from specstack.tree import DraftTree
from specstack.verify import VerifyResult, verify_rrs, verify_sample_walk

ALPHA = 1e-4  # false-failure probability budget of one test


class Toy:
    """Deterministic logits per context: the target draws them from a seeded normal; the draft is a
    noisy copy of the target (so its proposals are accepted sometimes, rejected sometimes)."""

    def __init__(self, vocab: int, sampling: SamplingParams, scale: float = 1.6, noise: float = 1.2) -> None:
        self.vocab, self.sampling, self.scale, self.noise = vocab, sampling, scale, noise
        self._p: dict[tuple[int, ...], torch.Tensor] = {}
        self._q: dict[tuple[int, ...], torch.Tensor] = {}

    def _normal(self, salt: int, ctx: tuple[int, ...]) -> torch.Tensor:
        key = salt
        for t in ctx:
            key = key * (self.vocab + 1) + t + 1
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(key))

    def target_logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self.scale * self._normal(1, ctx)

    def draft_logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return 0.8 * self.target_logits(ctx) + self.noise * self._normal(2, ctx)

    def p(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._p:
            self._p[ctx] = warp(self.target_logits(ctx), self.sampling)
        return self._p[ctx]

    def q(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._q:
            self._q[ctx] = warp(self.draft_logits(ctx), self.sampling)
        return self._q[ctx]


TreeBuilder = Callable[[Toy, tuple[int, ...], torch.Generator], DraftTree]


def _tree_builder(widths: tuple[int, ...], children) -> TreeBuilder:
    """A tree with widths[d] children under every node at depth d; children(toy, ctx, w, g) gives
    them as (token, q) pairs."""

    def build(toy: Toy, ctx: tuple[int, ...], g: torch.Generator) -> DraftTree:
        tree = DraftTree()
        frontier = [(-1, ctx)]
        for w in widths:
            nxt = []
            for node, c in frontier:
                for tok, q in children(toy, c, w, g):
                    nxt.append((tree.add(tok, node, q=q), c + (tok,)))
            frontier = nxt
        return tree

    return build


def sampled_tree(widths: tuple[int, ...]) -> TreeBuilder:
    """Children drawn from the draft's q without replacement (drafting.candidates.children_of, Gumbel
    top-k, in draw order), each carrying that q: an RRS tree."""
    return _tree_builder(widths, lambda toy, c, w, g: [(t, toy.q(c)) for t, _ in children_of(toy.q(c)[None], w, toy.sampling, g)[0]])


def fixed_tree(widths: tuple[int, ...]) -> TreeBuilder:
    """Deterministic proposals: the draft's top-widths[d] tokens at every node, no q (sample-walk)."""
    return _tree_builder(widths, lambda toy, c, w, g: [(t, None) for t in torch.topk(toy.draft_logits(c), w).indices.tolist()])


def target_rows(toy: Toy, ctx: tuple[int, ...], tree: DraftTree) -> torch.Tensor:
    """p rows in verify's convention: row 0 at the root, row i + 1 after node i."""
    ctxs = [ctx]
    for i, par in enumerate(tree.parent):
        ctxs.append((ctxs[par + 1]) + (tree.tokens[i],))
    return torch.stack([toy.p(c) for c in ctxs])


Verifier = Callable[[DraftTree, torch.Tensor, torch.Generator], VerifyResult]


def first_two(toy: Toy, build: TreeBuilder, verifier: Verifier, g: torch.Generator) -> tuple[int, int]:
    """The mini engine: propose, score, verify, append; until two tokens are emitted."""
    ctx: tuple[int, ...] = ()
    out: list[int] = []
    while len(out) < 2:
        tree = build(toy, ctx, g)
        result = verifier(tree, target_rows(toy, ctx, tree), g)
        assert len(result.tokens) == len(result.accepted) + 1
        assert [tree.tokens[i] for i in result.accepted] == result.tokens[:-1]
        out += result.tokens
        ctx += tuple(result.tokens)
    return out[0], out[1]


def run_and_check(toy: Toy, build: TreeBuilder, verifier: Verifier, n: int, seed: int) -> None:
    v = toy.vocab
    g = torch.Generator().manual_seed(seed)
    joint = np.zeros((v, v))
    for _ in range(n):
        x1, x2 = first_two(toy, build, verifier, g)
        joint[x1, x2] += 1
    p1 = toy.p(()).double().numpy()
    p12 = np.stack([p1[a] * toy.p((a,)).double().numpy() for a in range(v)])
    pv_first = chi2_pvalue(joint.sum(1), p1)
    pv_joint = chi2_pvalue(joint, p12)
    assert pv_first > ALPHA / 2, f"first token: p-value {pv_first:.3g}"
    assert pv_joint > ALPHA / 2, f"first two tokens: p-value {pv_joint:.3g}"


T1 = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("widths", [(1, 1), (3, 2), (2, 2, 1)], ids=["chain2", "tree3x2", "tree2x2x1"])
def test_rrs_is_lossless(widths):
    toy = Toy(6, T1)
    run_and_check(toy, sampled_tree(widths), verify_rrs, n=6000, seed=100 + len(widths) * 10 + widths[0])


@pytest.mark.parametrize("widths", [(1, 1), (3, 2)], ids=["chain2", "tree3x2"])
def test_sample_walk_is_lossless(widths):
    toy = Toy(6, T1)
    run_and_check(toy, fixed_tree(widths), verify_sample_walk, n=6000, seed=200 + widths[0])


def test_rrs_with_top_k_and_top_p_warps_p_and_q_alike():
    """q from warp(draft logits), p from warp(target logits), both with temperature, top-k and top-p:
    zero-probability tokens are never emitted and the kept ones follow the warped target."""
    sp = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    toy = Toy(7, sp)
    assert all(int((toy.p(c) > 0).sum()) < 7 for c in [(), (0,), (1,)])  # the warp really truncates
    run_and_check(toy, sampled_tree((3, 2)), verify_rrs, n=6000, seed=300)


def test_the_toy_draft_is_accepted_sometimes_and_rejected_sometimes():
    """Sanity of the setup (not of losslessness): chains of two are accepted to depth 0, 1 and 2 often
    enough that the tests above exercise acceptance, rejection with residuals, and bonus tokens."""
    toy = Toy(6, T1)
    g = torch.Generator().manual_seed(7)
    build = sampled_tree((1, 1))
    lengths = [len(verify_rrs(t, target_rows(toy, (), t), g).accepted) for t in (build(toy, (), g) for _ in range(500))]
    hist = np.bincount(lengths, minlength=3)
    assert all(h >= 50 for h in hist), hist
