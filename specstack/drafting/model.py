"""Model drafter: a small LM (sharing the target's tokenizer) proposes a best-first tree, or a chain (a
tree of width 1: `ChainDrafter`, BASS's drafts); either drafts for one row or, in a group, for many.

State: a row of its group's draft cache (drafting/batched_tree.py: a TreeGroup drafts the trees of many
rows in one draft forward per level; a drafter made without one is a group of one; draft_cache.py: the
tokens it has not run yet, `pending`, at least the root; the accepted nodes it ran committed; SPIRe
memories). A round runs, in the scratch:
  1. the pending tokens as a causal chain (catch-up; its last row is the root's distribution),
  2. then, level by level, the best unexpanded candidates as one tree block each (`grow`, a generator:
     it yields each level's candidates and the group, which runs every member's level in one forward,
     sends back their distributions).

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

from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext
from specstack.drafting.batched_tree import Growth, Level, TreeGroup
from specstack.drafting.candidates import CandidateTree, ChildPicker, NextTokens
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
    """Drafter (drafting/base.py) over a draft model, and a member of a TreeGroup (batched_tree.py). A
    subclass changes how the tree grows by overriding `grow` (and `level_shape` if its levels are more or
    wider), built from the public steps below: `selected`, `expand`, `max_run_depth`, and the round's
    `candidates`; `grow` yields the candidates it wants run and receives their distributions."""

    # Under sampling, sampled children carry the draft's q and a tree of them is verified by recursive
    # rejection sampling. A subclass whose trees are verified by sample-walk sets this False.
    carries_q = True

    def __init__(self, draft: LoadedModel, params: TreeParams, window: WindowSpec | None = None,
                 prefix: PrefixCache | None = None, group: TreeGroup | None = None) -> None:
        """window: a sliding-window KV for the draft (MagicDec: the target itself as its own draft);
        prefix: the draft's prefix cache, shared by the drafters of one draft model (None: none);
        group: the group it drafts with (its draft model's; window and prefix are the group's), None: a
        group of its own."""
        if group is not None and (window is not None or prefix is not None or group.draft is not draft):
            raise SpecstackError("a group's member drafts with the group's draft model, window and prefix cache")
        self.draft = draft
        self.params = params
        self.group = group if group is not None else TreeGroup(draft, window, prefix)
        self.state = self.group.state
        self.cache = self.state.cache
        self.target_layers = self.state.target_layers
        self.candidates = CandidateTree()  # this round's
        self.sized = False  # this round's tree is sized by the step's length rule (ctx.size)
        self._size: Callable[[Sequence[float]], int] | None = None  # ctx.size, while sized
        self.picker = ChildPicker(params.width, draft.config.vocab_size)
        self._tree_ids: list[int] = []  # candidate of each node of the proposed tree
        self._limit = params.budget  # this round's most nodes (params.budget, or less when the engine limits it)
        self.row = self.group.join(self)

    @property
    def pending(self) -> list[int]:
        return self.state.pending[self.row]

    def pending_bound(self) -> int:
        """The most pending tokens a round catches up on in a group (at most an accepted path and the
        bonus token; a longer chain, a prompt or what waited while drafting paused, is read ahead first)."""
        return self.params.depth + 2

    def level_shape(self) -> tuple[int, int]:
        """(most levels a round runs, most nodes a level runs): the scratch a round writes after its
        catch-up, each level padded in a group to its widest member's (`TreeGroup.join`). Best-first: a
        level expands at least one of the `budget` nodes, at most `expand_per_forward`."""
        return self.params.budget, self.params.expand_per_forward

    # -- the draft's cache ------------------------------------------------------------------------
    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.state.reset(self.row, prompt_ids, target_hidden)

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        """target_hidden: the target's hidden states of the root and the emitted path (drafting/base.py),
        for a draft with target_layers."""
        self.state.observe(self.row, tree, result, target_hidden,
                           lambda node: self.candidates[self._tree_ids[node]].slot)

    # -- proposing (a round: begin, grow level by level, finish; the group runs the forwards) -------
    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.group.propose_rows([self], [ctx])[0]

    def begin(self, ctx: DraftContext) -> bool:
        """Start a round; returns whether it runs the draft."""
        # sizing by the nodes' own scores is lossless for a greedy target and for sample-walk only
        self.sized = ctx.size is not None and (ctx.sampling.greedy or not self.carries_q)
        self._size = ctx.size if self.sized else None
        self.candidates = CandidateTree()
        self._limit = self.params.budget if ctx.limit is None else min(ctx.limit, self.params.budget)
        self._tree_ids = []
        # nothing will be verified: no draft forward; the pending tokens wait, however many steps drafting
        # pauses (the next round's catch-up runs them: read ahead in a group of several rows)
        self.state.ran[self.row] = self._limit != 0
        return self.state.ran[self.row]

    def finish(self, ctx: DraftContext) -> DraftTree:
        """The target batch as a DraftTree; where sizing by them is lossless (`begin`), each node carries
        its cumulative draft probability for the step's length rule."""
        self._tree_ids = self.selected()
        tree = self.candidates.draft_tree(self._tree_ids)
        if ctx.sampling.greedy or not self.carries_q:
            tree.confidence = [self.candidates.score(c) for c in self._tree_ids]
        return tree

    def grow(self, root: NextTokens, ctx: DraftContext) -> Growth:
        """Best-first: expand the best unexpanded nodes of the would-be target batch, a level of
        `expand_per_forward` nodes per draft forward, until none is left within the depth.
        root: the catch-up forward's distribution after the root (one row). Yields each level's nodes
        and receives their distributions (row j: after chosen[j])."""
        cands = self.candidates
        max_depth = self.max_run_depth()
        self.expand(-1, root, 0, ctx)
        while True:
            open_nodes = [i for i in self.selected() if not cands[i].expanded and cands.depth(i) <= max_depth]
            chosen = sorted(open_nodes, key=lambda i: -cands[i].score)[: self.params.expand_per_forward]
            if not chosen:
                return
            chosen.sort()  # topological order within the block
            dists = yield chosen
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
        room = self.draft.config.max_seq_len - (self.cache.next_pos[self.row] + len(self.pending))
        return min(min(self.params.depth, self._limit) - 1, room)  # a tree of n nodes is at most n deep

    def level(self, chosen: list[int], scratch: int) -> Level:
        """Candidates `chosen` (topologically ordered; each one's parent is expanded already or earlier in
        `chosen`) as a level's block, node j at scratch slot `scratch` + j: it is expanded once run."""
        cands = self.candidates
        for j, i in enumerate(chosen):
            cands[i].slot = scratch + j
        paths = [cands.path(i) for i in chosen]
        return Level([cands[i].token for i in chosen], [[cands[a].slot for a in path] for path in paths],
                     [[cands[a].token for a in path] for path in paths])


class ChainDrafter(ModelDrafter):
    """A chain of k draft tokens (BASS; Leviathan et al.): the best-first tree of width 1, each level
    running the chain's last token. Under the cost rule and a greedy target it stops where the rule would
    cut it, as a tree does (the nodes past the cut were drafted and never verified); BASS's rule chooses
    from whole chains (it gives no sizer)."""

    def __init__(self, draft: LoadedModel, k: int, window: WindowSpec | None = None,
                 prefix: PrefixCache | None = None, group: TreeGroup | None = None) -> None:
        super().__init__(draft, TreeParams.chain(k), window, prefix, group)


def chain_members(draft: LoadedModel, k: int, window: WindowSpec | None = None,
                  prefix: PrefixCache | None = None) -> Callable[[], ChainDrafter]:
    """A factory of chain drafters of one TreeGroup: in a batch, one draft forward a draft step for all
    their rows."""
    group = TreeGroup(draft, window, prefix)
    return lambda: ChainDrafter(draft, k, group=group)
