"""Verification as pure functions over (draft tree, target distributions) (DESIGN §5).

Conventions shared by every verifier:
- `tree` hangs off the root (the last emitted token, not yet in the target's cache);
- `p` has one row per tree position *before* a node is chosen: p[0] is the target's distribution at
  the root (for the root's children), p[i + 1] the distribution after node i (for node i's
  children). For greedy verification these rows are raw logits; for sampling, warped probabilities
  (sampling.warp, the same warp the draft's q went through).
- the result lists the accepted node ids (a root-to-node path) and the emitted tokens: the accepted
  nodes' tokens followed by exactly one token from the target (correction or bonus).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specstack.config import SamplingParams
from specstack.sampling import argmax_rows, sample, warp
from specstack.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]  # node ids, root-to-node order
    tokens: list[int]  # emitted: tokens of the accepted nodes + one target token

    @property
    def next_token(self) -> int:
        return self.tokens[-1]


class Rows(Protocol):
    """p as the sampling verifiers read it: one [V] row at a time, by position."""

    def __getitem__(self, i: int, /) -> torch.Tensor: ...


class WarpedRows:
    """The target's rows warped as a walk reaches them: a walk reads the rows of its accepted path and
    the node it stops at, not the whole tree's, and a warp of a large vocabulary (top-k, top-p) costs
    a visible share of a CPU step. Each row is warped alone, as the same row is in a batch."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingParams) -> None:
        self.logits, self.sampling = logits, sampling
        self.warped: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int, /) -> torch.Tensor:
        if i not in self.warped:
            self.warped[i] = warp(self.logits[i], self.sampling)
        return self.warped[i]


def _row(node: int) -> int:
    """Row of p holding the distribution for the children of `node` (-1 = root)."""
    return node + 1


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """Walk the tree along the target's argmax; emit the argmax where no child matches."""
    return walk_greedy(tree, argmax_rows(logits))


def walk_greedy(tree: DraftTree, argmax: Sequence[int]) -> VerifyResult:
    """verify_greedy given the argmax of each row (a batch's rows take theirs from one argmax over all)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parent, strict=True)):
        children.setdefault(par, {}).setdefault(tok, i)  # first child wins on duplicate tokens
    node, accepted = -1, []
    while True:
        want = argmax[_row(node)]
        nxt = children.get(node, {}).get(want)
        if nxt is None:
            return VerifyResult(accepted, [tree.tokens[i] for i in accepted] + [want])
        accepted.append(nxt)
        node = nxt


def _children(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parent):
        kids.setdefault(par, []).append(i)
    return kids


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(sample(p, generator))


def verify_sample_walk(tree: DraftTree, p: Rows, generator: torch.Generator | None = None) -> VerifyResult:
    """Lossless for any drafter, no q needed: draw x ~ p at the current node; descend into the child
    with token x if there is one, else emit x and stop (staged paper)."""
    kids = _children(tree)
    node, accepted = -1, []
    while True:
        x = _draw(p[_row(node)], generator)
        nxt = next((c for c in kids.get(node, []) if tree.tokens[c] == x), None)
        if nxt is None:
            return VerifyResult(accepted, [tree.tokens[i] for i in accepted] + [x])
        accepted.append(nxt)
        node = nxt


def verify_rrs(tree: DraftTree, p: Rows, generator: torch.Generator | None = None) -> VerifyResult:
    """Recursive rejection sampling (Jeon et al. 2024, Sequoia): the children of a node were drawn
    from q without replacement, in insertion order. Child x is accepted with probability
    min(1, p[x] / q[x]); on rejection p <- norm(max(p - q, 0)) and q[x] <- 0, q renormalised. If every
    child is rejected the emitted token is drawn from the final p. One child per node = the classic
    rule of Leviathan et al. / Chen et al."""
    kids = _children(tree)
    node, accepted = -1, []
    while True:
        p_cur = p[_row(node)].clone()
        children = kids.get(node, [])
        nxt = None
        if children:
            q_cur = tree.q[children[0]].to(p_cur).clone()
            for c in children:
                x = tree.tokens[c]
                ratio = p_cur[x] / q_cur[x] if q_cur[x] > 0 else torch.tensor(0.0)
                u = torch.rand((), generator=generator, device=p_cur.device)
                if u < ratio:
                    nxt = c
                    break
                residual = (p_cur - q_cur).clamp_(min=0)
                if residual.sum() > 0:  # p == q leaves no residual: then p is already right
                    p_cur = residual / residual.sum()
                q_cur[x] = 0
                if q_cur.sum() > 0:
                    q_cur = q_cur / q_cur.sum()
        if nxt is None:
            x = _draw(p_cur, generator)
            return VerifyResult(accepted, [tree.tokens[i] for i in accepted] + [x])
        accepted.append(nxt)
        node = nxt


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> VerifyResult:
    """The verifier the data calls for (never the method): greedy when sampling is off, recursive
    rejection sampling when every node carries its draft q, sample-walk otherwise. logits: [1 + n, V],
    the root's row then one per node."""
    if sampling.greedy:
        return verify_greedy(tree, logits)
    p = WarpedRows(logits, sampling)
    if len(tree) and all(q is not None for q in tree.q):
        return verify_rrs(tree, p, generator)
    return verify_sample_walk(tree, p, generator)
