"""draft2 of staged speculative decoding as a drafter (Spector & Ré 2023; DESIGN §4).

`NgramDrafter` (reset / propose / observe) hangs the staged paper's proposal tree off the root:
widths (12, 7, 4, 1, 1, 1) = 12 candidates, 7 under the best, 4 under its best, then a chain. The
context lookup's continuation (lookup.py) is the spine; the Katz trigram (katz.py) fills the siblings.
Proposals are deterministic (q = None), so sampling targets verify them by sample-walk. Widths
(1, 1, ...) make a chain; the step's length rule (drafting/batch_length.py) sets how much of it is
proposed (ctx.limit) and verified, from each node's `evidence`: its origin, the length of the context
match behind it, its depth.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specstack.drafting.base import DraftContext
from specstack.drafting.draft_length import Evidence
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
    lookup: ContextLookup = field(init=False)
    _proposed: DraftTree = field(init=False, default_factory=DraftTree)  # the last tree, before the engine cut it
    _learned: list[tuple[Evidence, bool]] = field(init=False, default_factory=list)  # for the next tree

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
        self._proposed, self._learned = DraftTree(), []

    def propose(self, ctx: DraftContext) -> DraftTree:
        widths = self.widths if ctx.limit is None else self.widths[: ctx.limit]  # n nodes are at most n deep
        tree = self.proposal_tree(ctx.tokens, widths)
        tree = tree if ctx.limit is None else tree.truncated(ctx.limit)
        ctx.lessons += self._learned
        self._learned = []
        self._proposed = tree
        return tree

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        """A deterministic proposal is accepted exactly when it equals the target's token: when the
        engine kept a prefix of the chain proposed and the target accepted all of it, the target's next
        token says whether the first node cut was right. The next propose tells the length rule (ctx.lessons),
        which so learns even from chains a batch's forward cost cut to nothing.
        (The next propose indexes the emitted tokens: ctx.tokens grows by result.tokens.)"""
        n, p = len(tree), self._proposed
        if len(result.accepted) == n < len(p) and p.parent[n] == n - 1 and p.evidence[n] is not None:
            self._learned.append((p.evidence[n], p.tokens[n] == result.next_token))

    # ---- the proposal tree ----------------------------------------------------------------------
    def proposal_tree(self, context: Sequence[int], widths: Sequence[int] | None = None) -> DraftTree:
        """A tree hanging off context[-1]: widths[0] siblings at level 1, widths[1] children under
        the best of them, and so on (staged paper: 12, 7, 4, 1, 1, 1). Siblings are the context
        lookup's candidates first (origin "context"; the best match's continuation is the spine),
        then the trigram's top tokens (origin "draft2"); no token twice among siblings.
        Each node's evidence (what a length rule learns acceptance rates of): ("context", n, depth) for
        the spine, continuing a match of the last n tokens; ("context", 0, depth) for another context
        candidate; ("draft2", b, depth) for a trigram token, b = 2, 1, 0 as its probability is >= 0.5,
        >= 0.2 or less. Depths past 4 share a class."""
        widths = self.widths if widths is None else widths
        lookup = self.lookup
        lookup.attach(context)
        base = len(lookup)
        n, spine = lookup.continuation(len(widths))
        if n < self.context_min_n:
            spine = []
        tree = DraftTree()
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
                    tree.add(t, parent, ev[0], evidence=ev)
                parent = first
                lookup.extend((cand[0],))  # the next level is proposed under the best node
        finally:
            lookup.truncate(base)
        return tree
