"""Tokens a grammar forces, as drafts (origin `grammar`) hung onto a row's tree (grammar.py says which).

The forced chain continues from the root. Where the drafter's tree already holds its first tokens, the
chain follows those nodes; the rest hangs below the last one followed as new nodes. The drafter's nodes
keep their ids and come first (a prefix of its tree, cut when the chain needs room within the step's
cap), so what the target accepted of them maps back to the drafter's own tree unchanged. Under sampling
a grammar node carries no q, so a tree with one is verified by sample-walk (lossless for any drafter).
"""
from __future__ import annotations

from collections.abc import Sequence

from specstack.tree import DraftTree


def _follow(tree: DraftTree, chain: Sequence[int]) -> tuple[int, int]:
    """(deepest node of `tree` on the chain's path (-1: the root), how many chain tokens it covers)."""
    node, covered = -1, 0
    for token in chain:
        nxt = next((i for i in range(len(tree)) if tree.parent[i] == node and tree.tokens[i] == token), None)
        if nxt is None:
            break
        node, covered = nxt, covered + 1
    return node, covered


def with_forced(tree: DraftTree, chain: Sequence[int], cap: int) -> tuple[DraftTree, int]:
    """(the tree with the chain hung on, within `cap` nodes; how many of `tree`'s first nodes it keeps)."""
    if not chain or cap <= 0:
        return tree.truncated(max(cap, 0)), min(len(tree), max(cap, 0))
    keep = min(len(tree), cap)
    while True:
        own = tree.truncated(keep)
        node, covered = _follow(own, chain)
        rest = list(chain[covered:])
        if keep + len(rest) <= cap or keep == 0:
            break
        keep = max(0, cap - len(rest))  # the chain first: it is what the grammar allows alone
    merged = DraftTree(list(own.tokens), list(own.parent), list(own.origin), list(own.q), list(own.confidence),
                       list(own.evidence), own.learned)
    for token in rest[: cap - keep]:
        node = merged.add(token, node, "grammar")
    return merged, keep
