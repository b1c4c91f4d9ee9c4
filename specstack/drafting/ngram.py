"""draft2 of staged speculative decoding as a drafter (Spector & Ré 2023; DESIGN §4).

`NgramDrafter` (reset / propose / observe) hangs the staged paper's proposal tree off the root:
widths (12, 7, 4, 1, 1, 1) = 12 candidates, 7 under the best, 4 under its best, then a chain. The
context lookup's continuation (lookup.py) is the spine; the Katz trigram (katz.py) fills the siblings.
Proposals are deterministic (q = None), so sampling targets verify them by sample-walk. With a
`length` rule (draft_length.py: BASS's dynamic rule, or the cost-aware choice) it proposes a chain
whose length the rule sets each step instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specstack.drafting.base import DraftContext
from specstack.drafting.draft_length import ChainLength, Evidence
from specstack.drafting.katz import KatzTrigram
from specstack.drafting.lookup import ContextLookup
from specstack.tree import DraftTree, Origin
from specstack.verify import VerifyResult

STAGED_WIDTHS: tuple[int, ...] = (12, 7, 4, 1, 1, 1)  # staged paper: 12 candidates, 7 under the best, ...

# ---------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class NgramDrafter:
    """Staged paper's draft2 as a stand-alone drafter (deterministic proposals, q = None).

    The staged drafter calls `proposal_tree(context, widths)` directly (context = the committed
    tokens + its speculative spine); the context lookup follows whatever context it is given."""
    model: KatzTrigram | None = None  # None: context lookup only
    widths: tuple[int, ...] = STAGED_WIDTHS
    max_n: int = 3  # longest suffix the context lookup matches
    context_min_n: int = 1  # shortest context match whose continuation is proposed
    context_per_level: int = 5  # at most this many context candidates among a level's siblings
    # set: propose a chain whose length this rule chooses each step (widths unused)
    length: ChainLength | None = None
    lookup: ContextLookup = field(init=False)
    _classes: list[Evidence] = field(init=False, default_factory=list)  # of the chain last proposed
    _proposed: list[int] = field(init=False, default_factory=list)  # its tokens (before the engine cut it)

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        if any(w < 0 for w in self.widths):
            raise ValueError(f"widths must be >= 0: {self.widths}")
        self.lookup = ContextLookup(self.max_n)

    # ---- Drafter protocol -----------------------------------------------------------------------
    target_layers: tuple[int, ...] = ()  # reads no target activations
    group = None  # proposes alone

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.lookup.reset(prompt_ids)
        self._classes = []
        if self.length is not None:  # every sequence starts afresh: its speed never depends on the last
            self.length.reset()

    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.length is None:
            tree = self.proposal_tree(ctx.tokens, self.widths)
            return tree if ctx.limit is None else tree.truncated(ctx.limit)
        longest = self.length.longest() if ctx.limit is None else min(ctx.limit, self.length.longest())
        tree, classes = self._grow(ctx.tokens, (1,) * longest)
        n = self.length.choose(classes)
        self._classes = classes[:n]
        self._proposed = tree.tokens[:n]
        tree = tree.truncated(n)
        # proposals are deterministic: a batch's length rule may size the step by them (lossless)
        tree.confidence = self.length.confidence(self._classes) or [None] * n
        return tree

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        # the next propose indexes the emitted tokens (ctx.tokens grows by result.tokens)
        if self.length is not None:
            self.length.observe(*self._shadow(result.tokens))

    def _shadow(self, emitted: Sequence[int]) -> tuple[list[Evidence], int]:
        """What the emitted tokens say about the chain as proposed, verified or not: a deterministic
        proposal is accepted exactly when the target's token (greedy, or sampled by sample-walk) equals
        it, so the proposal's first m tokens, m = its common prefix with the emitted tokens, were right,
        and its (m+1)-th wrong if the emitted tokens go on past m. A batch's length rule often verifies
        none of a row's chain (the forward's cost): the rates still learn, from the step's own token.
        Returns (classes, accepted) for the length rule: the chain up to its first known failure."""
        m = 0
        while m < min(len(self._proposed), len(emitted)) and self._proposed[m] == emitted[m]:
            m += 1
        if m < len(emitted) and m < len(self._proposed):  # the (m+1)-th proposed token was wrong
            return self._classes[: m + 1], m
        return self._classes[:m], m  # right as far as the emitted tokens go

    # ---- the proposal tree ----------------------------------------------------------------------
    def proposal_tree(self, context: Sequence[int], widths: Sequence[int] | None = None) -> DraftTree:
        """A tree hanging off context[-1]: widths[0] siblings at level 1, widths[1] children under
        the best of them, and so on (staged paper: 12, 7, 4, 1, 1, 1). Siblings are the context
        lookup's candidates first (origin "context"; the best match's continuation is the spine),
        then the trigram's top tokens (origin "draft2"); no token twice among siblings."""
        return self._grow(context, self.widths if widths is None else widths)[0]

    def _grow(self, context: Sequence[int], widths: Sequence[int]) -> tuple[DraftTree, list[Evidence]]:
        """The proposal tree and each node's evidence class (what a chain-length rule learns from):
        ("context", n, depth) for the spine, continuing a match of the last n tokens; ("context", 0,
        depth) for another context candidate; ("draft2", b, depth) for a trigram token, b = 2, 1, 0 as
        its probability is >= 0.5, >= 0.2 or less. Depths past 4 share a class."""
        lookup = self.lookup
        lookup.attach(context)
        base = len(lookup)
        n, spine = lookup.continuation(len(widths))
        if n < self.context_min_n:
            spine = []
        tree = DraftTree()
        evidence: list[Evidence] = []
        parent = -1
        try:
            for d, width in enumerate(widths):
                if width <= 0:
                    break
                depth = min(d + 1, 4)
                cand: list[int] = []
                found: list[tuple[Origin, int, int]] = []  # evidence; its first field is the origin
                if d < len(spine):
                    cand.append(spine[d])
                    found.append(("context", n, depth))
                room = min(width, self.context_per_level)
                if room > len(cand):
                    for t in lookup.next_tokens(room, self.context_min_n):
                        if t not in cand:
                            cand.append(t)
                            found.append(("context", 0, depth))
                            if len(cand) >= room:
                                break
                if self.model is not None and len(cand) < width:
                    for t, prob in self.model.top(lookup.tokens[-2:], width + len(cand)):
                        if t not in cand:
                            cand.append(t)
                            found.append(("draft2", 2 if prob >= 0.5 else 1 if prob >= 0.2 else 0, depth))
                            if len(cand) >= width:
                                break
                if not cand:
                    break
                first = len(tree)
                for t, ev in zip(cand[:width], found[:width], strict=True):
                    tree.add(t, parent, ev[0])
                    evidence.append(ev)
                parent = first
                lookup.extend((cand[0],))  # the next level is proposed under the best node
        finally:
            lookup.truncate(base)
        return tree, evidence
