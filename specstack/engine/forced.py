"""Tokens a grammar forces, as drafts (origin `grammar`; grammar.py says which).

Where a row's grammar forces tokens from its root (a schema's next key, a closing bracket), they are the
row's tree for the step: a chain of deterministic proposals, which the target verifies like any other
(lossless: a different tokenization of the same bytes is simply a rejection). The row's drafter does no
work that step (its limit is 0) and catches up on the emitted tokens after. Each node carries evidence
("grammar", depth), so a cost-aware length rule learns how often forced tokens are accepted and keeps
as many as pay for the forward's cost; a long forced chain is not verified whole where a forward over
many tokens costs many steps (an int4 CPU target).
"""
from __future__ import annotations

from collections.abc import Sequence

from specstack.tree import DraftTree

DEEPEST_CLASS = 4  # depths past it share one acceptance class


def forced_chain(tokens: Sequence[int], cap: int) -> DraftTree:
    """The first `cap` forced tokens as a chain off the root, each with its evidence class."""
    chain = DraftTree.chain(list(tokens[:cap]), origin="grammar")
    chain.evidence = [("grammar", min(d, DEEPEST_CLASS)) for d in range(1, len(chain) + 1)]
    return chain
