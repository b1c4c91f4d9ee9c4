"""Chains from one draft model for many rows at once (BASS, DESIGN §6): one draft forward per draft
step for every row of a batch.

Terms. A `ChainGroup` owns the draft's KV cache with one row per member; a member (`ChainRow`) is the
drafter of one row of the engine (drafting/base.py's Drafter), and names its group in `group`, so the
engine asks the group for all of its members' chains together (`propose_rows`). A lone row is a group
of one: the one chain drafter of a draft model.

State per member, as for ModelDrafter (drafting/draft_cache.py): the tokens the draft has not run yet
(`pending`: at least the root), the accepted nodes it ran committed, SPIRe memories written from the
target's activations for every member at once before a round. A round, for the members that propose:
  1. catch-up: every member's pending tokens as a causal chain, padded to the longest (PAD layout,
     attention.build_batch with n_valid); the last real row of each is the root's next-token
     distribution;
  2. draft steps 1 .. k - 1: one token a member (the one just drafted), appended to the round's
     scratch; a member sees its own pending slots, its own drafted slots and itself, never another
     member's (the mask) — members whose chain is done sit the step out (n_valid 0);
  3. each member's chain as a DraftTree: tokens drawn greedily (the argmax) or from the warped q of its
     own sampling parameters and generator (nodes carry q: recursive rejection sampling verifies them);
     a greedy chain's nodes carry their cumulative draft probability as `confidence`.
A member's node i sits in the round's scratch at slot catch-up width + i if a draft step ran it
(`run`: every node but the last, unless the draft then gave no token), else it was never run.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specstack.attention import build_batch
from specstack.cache import KVCache
from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext, Drafter
from specstack.drafting.candidates import ChildPicker
from specstack.drafting.draft_cache import DraftCache
from specstack.models.base import LoadedModel, ModelOutput
from specstack.prefix_cache import PrefixCache
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


class ChainGroup:
    """The shared part: the draft model, its cache (a row per member) and the batched rounds."""

    def __init__(self, draft: LoadedModel, k: int, window: WindowSpec | None = None,
                 prefix: PrefixCache | None = None) -> None:
        if k < 1:
            raise ValueError(f"a chain needs k >= 1, got {k}")
        self.draft, self.k, self.window = draft, k, window
        # the context, plus one round's scratch past a row's committed tokens: a catch-up padded to the
        # longest pending chain (at most k + 1 once a row has started) and k - 1 drafted tokens
        self.state = DraftCache(draft, draft.config.max_seq_len + 2 * k + 4, window, prefix)
        self.cache = self.state.cache
        self.members: list[ChainRow] = []
        self.picker = ChildPicker(1, draft.config.vocab_size)
        self.width = 0  # this round's catch-up width (the slot of a row's first drafted node)

    def member(self) -> ChainRow:
        """A new member with a row of its own."""
        m = ChainRow(self, self.state.add_row())
        self.members.append(m)
        return m

    def draft_forwards(self) -> int:
        return self.state.forwards

    # -- a round ------------------------------------------------------------------------------------
    def propose_rows(self, drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Every member's chain (members of this group, each with its row's context), drafted together."""
        members = [m for m in drafters if isinstance(m, ChainRow) and m.group is self]
        if len(members) != len(drafters):
            raise ValueError("a chain group proposes for its own members only")
        self.state.write_memories()
        cache, dev = self.cache, self.state.device
        for m, ctx in zip(members, ctxs, strict=True):
            m.length = self.k if ctx.limit is None else max(0, min(self.k, ctx.limit))
            # every drafted token but the last is run: its position must stay within the draft's context
            room = self.draft.config.max_seq_len - (cache.next_pos[m.row] + len(m.pending))
            m.length, m.run = min(m.length, max(0, room + 1)), 0
            # nothing will be verified: no draft forward, the pending tokens wait (up to a bound, so the
            # next catch-up stays short); a reader's pending token is the root alone and never waits long
            self.state.ran[m.row] = m.length > 0 or len(m.pending) > self.k
        active = [(m, ctx) for m, ctx in zip(members, ctxs, strict=True) if self.state.ran[m.row]]
        trees = {m.row: DraftTree() for m in members}
        if not active:
            return [trees[m.row] for m in members]
        # a long pending chain (a prompt) is read first, packed, so the padded catch-up stays short
        self.state.read_ahead([m.row for m, _ in active if len(m.pending) > self.k + 1])
        rows = cache.batch_size
        # 1. catch-up, padded to the longest pending chain
        counts = [0] * rows
        for m, _ in active:
            counts[m.row] = len(m.pending)
        width = self.width = max(counts)
        tokens = torch.zeros(rows, width, dtype=torch.long, device=dev)
        for m, _ in active:
            tokens[m.row, : len(m.pending)] = torch.tensor(m.pending, device=dev)
        index = torch.tensor([m.row * width + len(m.pending) - 1 for m, _ in active], device=dev)
        out = self.state.forward(tokens, build_batch(cache, width, n_valid=counts), index)
        self._draw(active, out, trees)
        # 2. draft steps: each member runs its last drafted token, while its chain is short of its length
        for step in range(1, max(m.length for m, _ in active)):
            going = [(m, ctx) for m, ctx in active if m.length > step]
            if not going:
                break
            mask = torch.zeros(rows, 1, cache.scratch + 1, dtype=torch.bool)
            offsets = torch.zeros(rows, 1, dtype=torch.long)
            n_valid = [0] * rows
            ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
            for m, _ in going:
                n = len(m.pending)
                mask[m.row, 0, :n] = True  # its pending chain
                mask[m.row, 0, width : width + step - 1] = True  # its drafted tokens run before
                offsets[m.row, 0] = n + step - 1  # d_step sits one past the root, step - 1 further
                n_valid[m.row] = 1
                ids[m.row, 0] = trees[m.row].tokens[-1]
                m.run += 1
            batch = build_batch(cache, 1, mask, offsets, n_valid, append=True)
            index = torch.tensor([m.row for m, _ in going], device=dev)
            out = self.state.forward(ids, batch, index)
            self._draw(going, out, trees)
        return [trees[m.row] for m in members]

    def _draw(self, rows: Sequence[tuple[ChainRow, DraftContext]], out: ModelOutput, trees: dict[int, DraftTree]) -> None:
        """The next node of each row's chain from its row of `out` (logits [1, len(rows), V'])."""
        for j, (m, ctx) in enumerate(rows):
            tree = trees[m.row]
            if len(tree) >= m.length:
                continue  # a row that must only catch up
            nxt = self.picker.pick(ModelOutput(out.logits[:, j : j + 1], {}, out.vocab_ids), ctx, [tree.tokens])
            kids = nxt.children(0)
            if not kids:
                m.length = len(tree)  # the draft gives no token (all of q outside the target's)
                continue
            token, prob = kids[0]
            greedy = ctx.sampling.greedy
            before = tree.confidence[-1] if len(tree) else 1.0  # a greedy chain's nodes all carry theirs
            score = (before if before is not None else 1.0) * prob if greedy else None
            tree.add(token, len(tree) - 1, "draft", None if greedy else nxt.q(0), score)


class ChainRow:
    """One row's drafter in a ChainGroup (drafting/base.py's Drafter)."""

    def __init__(self, group: ChainGroup, row: int) -> None:
        self.group, self.row = group, row
        self.target_layers = group.state.target_layers
        self.length = 0  # nodes this round's chain may have
        self.run = 0  # this round's drafted nodes the draft ran (from the first on)

    @property
    def cache(self) -> KVCache:
        return self.group.cache

    @property
    def pending(self) -> list[int]:
        return self.group.state.pending[self.row]

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.group.state.reset(self.row, prompt_ids, target_hidden)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.group.propose_rows([self], [ctx])[0]

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        width = self.group.width
        self.group.state.observe(self.row, tree, result, target_hidden, lambda i: width + i if i < self.run else -1)
