"""Model drafter: a small LM (sharing the target's tokenizer) proposes a best-first tree (a chain is a
tree of width 1; the chain drafter of one row or many is drafting/batched_chain.py).

State: the draft's cache, one row (drafting/draft_cache.py: the tokens it has not run yet, `pending`,
at least the root; the accepted nodes it ran committed; SPIRe memories). A round runs, in the scratch:
  1. the pending tokens as a causal chain (catch-up; its last row is the root's distribution),
  2. then, level by level, the best unexpanded candidates as one tree block each (`grow`).

Tree (staged paper, DESIGN §4): the round's candidates (drafting/candidates.py) are scored by
cumulative draft probability; the target batch is the `budget` best. Greedy target: the top-`width`
children of each expanded node. Sampling target: `width` children drawn from the warped q without
replacement, so recursive rejection sampling can use q (CandidateTree.rank says how they are kept).
Where sizing by them is lossless (a greedy target, or trees verified by sample-walk) nodes carry their
score as `confidence`, and the step's length rule may size the batch below `budget` while it grows
(`sized`, by ctx.size): the draft expands no node the rule would cut.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specstack.attention import build_batch, scratch_tree_mask
from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext
from specstack.drafting.candidates import CandidateTree, ChildPicker, NextTokens
from specstack.drafting.draft_cache import DraftCache
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.prefix_cache import PrefixCache
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


@dataclass(frozen=True)
class TreeParams:
    width: int = 4  # c: children per expanded node
    budget: int = 36  # n: nodes sent to the target
    depth: int = 8  # D: maximum depth
    expand_per_forward: int = 4  # nodes the draft expands in one forward (a level of the search)

    def __post_init__(self) -> None:
        if min(self.width, self.budget, self.depth, self.expand_per_forward) < 1:
            raise SpecstackError(f"tree parameters must be >= 1: {self}")

    @staticmethod
    def chain(k: int) -> TreeParams:
        return TreeParams(width=1, budget=k, depth=k, expand_per_forward=1)


class ModelDrafter:
    """Drafter (drafting/base.py) over a draft model. A subclass changes how the tree grows by
    overriding `grow` (and `scratch_bound` if it runs more nodes a round), built from the public
    steps below: `selected`, `run`, `expand`, `max_run_depth`, and the round's `candidates`."""

    # Under sampling, sampled children carry the draft's q and a tree of them is verified by recursive
    # rejection sampling. A subclass whose trees are verified by sample-walk sets this False.
    carries_q = True
    group = None  # proposes alone

    def __init__(self, draft: LoadedModel, params: TreeParams, capacity: int | None = None,
                 window: WindowSpec | None = None, prefix: PrefixCache | None = None) -> None:
        """window: a sliding-window KV for the draft (MagicDec: the target itself as its own draft);
        prefix: the draft's prefix cache, shared by the drafters of one draft model (None: none)."""
        self.draft = draft
        self.params = params
        self.state = DraftCache(draft, capacity or draft.config.max_seq_len + self.scratch_bound(), window, prefix)
        self.state.add_row()
        self.cache = self.state.cache
        self.target_layers = self.state.target_layers
        self.candidates = CandidateTree()  # this round's
        self.sized = False  # this round's tree is sized by the step's length rule (ctx.size)
        self._size: Callable[[Sequence[float]], int] | None = None  # ctx.size, while sized
        self._picker = ChildPicker(params.width, draft.config.vocab_size)
        self._tree_ids: list[int] = []  # candidate of each node of the proposed tree
        self._limit = params.budget  # this round's most nodes (params.budget, or less when the engine limits it)

    @property
    def pending(self) -> list[int]:
        return self.state.pending[0]

    def scratch_bound(self) -> int:
        """Most scratch slots one round can write: the pending tokens (at most an accepted path and
        the bonus token) plus every node expanded."""
        return self.params.depth + 2 + self.params.budget

    # -- the draft's cache ------------------------------------------------------------------------
    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.state.reset(0, prompt_ids, target_hidden)

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        """target_hidden: the target's hidden states of the root and the emitted path (drafting/base.py),
        for a draft with target_layers."""
        self.state.observe(0, tree, result, target_hidden, lambda node: self.candidates[self._tree_ids[node]].slot)

    # -- proposing --------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        model = self.draft.model
        # sizing by the nodes' own scores is lossless for a greedy target and for sample-walk only
        self.sized = ctx.size is not None and (ctx.sampling.greedy or not self.carries_q)
        self._size = ctx.size if self.sized else None
        self.candidates = CandidateTree()
        self._limit = self.params.budget if ctx.limit is None else min(ctx.limit, self.params.budget)
        # nothing will be verified: no draft forward; the pending tokens wait (up to a bound, so the next
        # catch-up stays within the scratch)
        self.state.ran[0] = not (self._limit == 0 and len(self.pending) <= self.params.depth)
        self._tree_ids = []
        if not self.state.ran[0]:
            return DraftTree()
        self.state.write_memories()
        # 1. catch up on the pending tokens (the last one is the root): only the root's row is scored
        pend = torch.tensor([self.pending], device=model.device)
        out = model.forward(pend, build_batch(self.cache, len(self.pending)), self.cache,
                            logit_rows=slice(-1, None))
        # 2. grow the candidate tree
        self.grow(self._picker.pick(out, ctx), ctx)
        # 3. the target batch as a DraftTree; where sizing by them is lossless (above), each node carries
        # its cumulative draft probability for the step's length rule
        self._tree_ids = self.selected()
        tree = self.candidates.draft_tree(self._tree_ids)
        if ctx.sampling.greedy or not self.carries_q:
            tree.confidence = [self.candidates.score(c) for c in self._tree_ids]
        return tree

    def grow(self, root: NextTokens, ctx: DraftContext) -> None:
        """Best-first: expand the best unexpanded nodes of the would-be target batch, a level of
        `expand_per_forward` nodes per draft forward, until none is left within the depth.
        root: the catch-up forward's distribution after the root (one row)."""
        cands = self.candidates
        max_depth = self.max_run_depth()
        self.expand(-1, root, 0, ctx)
        while True:
            open_nodes = [i for i in self.selected() if not cands[i].expanded and cands.depth(i) <= max_depth]
            chosen = sorted(open_nodes, key=lambda i: -cands[i].score)[: self.params.expand_per_forward]
            if not chosen:
                return
            chosen.sort()  # topological order within the block
            dists = self.run(chosen, ctx)
            for row, i in enumerate(chosen):
                self.expand(i, dists, row, ctx)

    def selected(self) -> list[int]:
        """Candidate ids of the target batch: the `budget` best (or as many of them as the step's length
        rule would keep, for a sized tree), parents before children."""
        order = self.candidates.best(self._limit)
        if self._size is not None:
            order = order[: self._size([self.candidates.score(i) for i in order])]
        return sorted(order)

    def expand(self, parent: int, dists: NextTokens, row: int, ctx: DraftContext) -> None:
        """Add the children of an expanded node (-1: the root), row `row` of `dists`, as candidates
        (tokens already there are kept as they are); under sampling they carry the row's q."""
        q = None if ctx.sampling.greedy or not self.carries_q else dists.q(row)
        self.candidates.add_children(parent, dists.children(row), q)

    def max_run_depth(self) -> int:
        """Deepest node the draft may run: its children stay within `depth`, and its position
        (root position + depth) within the draft's context."""
        room = self.draft.config.max_seq_len - (self.cache.next_pos[0] + len(self.pending))
        return min(min(self.params.depth, self._limit) - 1, room)  # a tree of n nodes is at most n deep

    def run(self, chosen: list[int], ctx: DraftContext) -> NextTokens:
        """One draft forward over candidates `chosen` (topologically ordered; each one's parent is
        expanded already or earlier in `chosen`), appended to this round's scratch. Row j of the
        result is the next-token distribution after chosen[j]."""
        model, cands = self.draft.model, self.candidates
        scratch = self.cache.scratch
        for j, i in enumerate(chosen):
            cands[i].slot = scratch + j
        # every node sees the pending chain up to the root, its expanded ancestors and itself; it sits
        # at the root's position + its depth (the root is the last pending token)
        paths = [cands.path(i) for i in chosen]
        slots = [[cands[a].slot for a in path] for path in paths]
        mask = scratch_tree_mask(slots, len(self.pending), scratch + len(chosen))
        offsets = torch.tensor([len(path) for path in paths], device=model.device) + len(self.pending) - 1
        toks = torch.tensor([[cands[i].token for i in chosen]], device=model.device)
        batch = build_batch(self.cache, len(chosen), mask, offsets, append=True)
        return self._picker.pick(model.forward(toks, batch, self.cache), ctx,
                                 [[cands[a].token for a in path] for path in paths])
