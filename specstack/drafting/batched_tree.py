"""Trees from one draft model for many rows at once (DESIGN §4, §6): one draft forward per level of the
rows' trees, whatever the number of rows.

Terms. A `TreeGroup` owns the draft's KV cache with one row per member (drafting/draft_cache.py); a member
(`TreeMember`: drafting/model.py's ModelDrafter, the best-first tree, or staged.py's StagedDrafter) keeps
its own round (its candidate tree, its picks, its size) and grows it as a *generator* (`grow`): each
level it yields the candidates it wants run (`chosen`) and receives their next-token distributions. The
group drives every member's generator in lockstep, so the engine, which asks the group for all of its
members' trees together (`propose_rows`), pays one draft forward per level for all rows, not one per
row. A lone ModelDrafter is a group of one (its forwards are the ones it always ran).

A round, for the members that draft (`begin`):
  1. catch-up: every member's pending tokens as a causal chain, packed (the target's SPLIT layout); the
     last token of each is its root's distribution, from which its generator starts. In a group of
     several rows a long pending chain (a prompt, or what waited while drafting paused) is read ahead
     first (DraftCache.read_ahead), so a round's scratch stays short;
  2. levels: each member's `chosen` nodes (`Level`: tokens, the scratch slots of their paths), packed
     (attention.packed_append_batch: the linear layers see real nodes only, attention pads each row to
     the widest), appended to the round's scratch; a node sees its own row's pending slots and
     its ancestors' slots (attention.scratch_tree_mask, a mask per row), never another row's; it sits at
     its root's position + its depth. Each member gets its rows of the output (its picker, its context:
     its sampling parameters, generator and logits rule) and yields its next level, until every
     generator is done (a member that is done sits the next levels out: it takes no tokens);
  3. each member's target batch as a DraftTree (`finish`).
A member's node j of a level sits at the scratch slot the level starts at + j (`Level`), the slot its
`observe` commits if the target accepts it (packed or not: a block takes the widest row's slots in every
row). A lone member's blocks are [1, T] (nothing to pack), and so are those of a draft that reads the
target's activations (its feature input reads [B, T] blocks): padded to the widest row's.
"""
from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from specstack.attention import build_batch, packed_append_batch, row_blocks_batch, scratch_tree_mask
from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext, Drafter
from specstack.drafting.candidates import ChildPicker, NextTokens
from specstack.drafting.draft_cache import DraftCache
from specstack.models.base import LoadedModel, ModelOutput
from specstack.prefix_cache import PrefixCache
from specstack.tree import DraftTree

# a member's round: yields the candidates to run next (topologically ordered), receives their distributions
Growth = Generator[list[int], NextTokens, None]


@dataclass(frozen=True)
class Level:
    """A member's nodes of one level's forward: node j is `tokens[j]`, written at scratch slot
    `slots[j][-1]`; slots[j] are the scratch slots of its path (its ancestors, then itself: its depth is
    their count) and paths[j] its tokens after the root (for the request's logits rule)."""

    tokens: list[int]
    slots: list[list[int]]
    paths: list[list[int]]


class TreeMember(Protocol):
    """What a TreeGroup asks of a member: its row, its round as a generator, its picks."""

    row: int  # its row of the group's DraftCache
    picker: ChildPicker

    @property
    def pending(self) -> list[int]: ...

    def pending_bound(self) -> int:
        """The most pending tokens its catch-up runs in a group of several rows (longer: read ahead)."""

    def level_shape(self) -> tuple[int, int]:
        """(most levels a round runs, most nodes a level runs)."""

    def begin(self, ctx: DraftContext) -> bool:
        """Start a round; False: it runs no draft forward (nothing would be verified; its pending wait)."""

    def grow(self, root: NextTokens, ctx: DraftContext) -> Growth:
        """The round's candidate tree, from the root's distribution (one row), level by level."""

    def level(self, chosen: list[int], scratch: int) -> Level:
        """Candidates `chosen` as the level's block, written from scratch slot `scratch` on."""

    def finish(self, ctx: DraftContext) -> DraftTree:
        """The round's target batch."""


class _RowBlock(NamedTuple):
    """A member's nodes of a level, as its cache row takes them: build_batch's block mask with append
    [n, scratch + n], positions from its next one [n], tokens."""

    mask: torch.Tensor
    offsets: torch.Tensor
    tokens: list[int]


@dataclass
class _Growing:
    member: TreeMember
    ctx: DraftContext
    growth: Growth
    chosen: list[int] | None  # the candidates it wants run next; None: its tree is grown


class TreeGroup:
    """The shared part: the draft model, its cache (a row per member) and the batched rounds."""

    def __init__(self, draft: LoadedModel, window: WindowSpec | None = None, prefix: PrefixCache | None = None) -> None:
        """window: the draft's sliding-window KV (MagicDec); prefix: the draft's prefix cache (None: none)."""
        self.draft = draft
        # rows grow as they read; each member that joins allows the scratch its rounds write (`join`)
        self.state = DraftCache(draft, draft.config.max_seq_len, window, prefix)
        self.cache = self.state.cache
        self.members: list[TreeMember] = []
        self._by_id: dict[int, TreeMember] = {}
        # the members' most: pending tokens a catch-up runs, levels a round runs, nodes a level runs
        self._pending = self._levels = self._width = 0

    def join(self, member: TreeMember) -> int:
        """A new member's row. A round's scratch holds the catch-up and the levels, each as wide as the
        widest member's: rows may grow to the context plus that, for the widest and longest members."""
        levels, width = member.level_shape()
        self._pending = max(self._pending, member.pending_bound())
        self._levels, self._width = max(self._levels, levels), max(self._width, width)
        self.state.allow(self.draft.config.max_seq_len + self._pending + self._levels * self._width)
        self.members.append(member)
        self._by_id[id(member)] = member
        return self.state.add_row()

    def draft_forwards(self) -> int:
        return self.state.forwards

    # -- a round ------------------------------------------------------------------------------------
    def propose_rows(self, drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Every member's tree (members of this group, each with its row's context), drafted together."""
        members = [self._by_id.get(id(d)) for d in drafters]  # (members live as long as the group: ids stay theirs)
        rows = [(m, ctx) for m, ctx in zip(members, ctxs, strict=True) if m is not None]
        if len(rows) != len(drafters):
            raise ValueError("a tree group proposes for its own members only")
        self.state.write_memories()
        drafting = [(m, ctx) for m, ctx in rows if m.begin(ctx)]
        if drafting:
            self._round(drafting)
        return [m.finish(ctx) if self.state.ran[m.row] else DraftTree() for m, ctx in rows]

    def _round(self, drafting: list[tuple[TreeMember, DraftContext]]) -> None:
        cache = self.cache
        if cache.batch_size > 1:  # (one row pads nothing: it runs its pending chain as it is)
            self.state.read_ahead([m.row for m, _ in drafting if len(m.pending) > m.pending_bound()])
        # 1. catch-up: each member's pending chain; the last real row of each is its root's distribution
        out = self._catch_up(drafting)
        live = []
        for j, (m, ctx) in enumerate(drafting):
            growth = m.grow(m.picker.pick(_rows(out, j, 1), ctx), ctx)
            live.append(_Growing(m, ctx, growth, _next(growth, None)))
        # 2. one forward a level for every member still growing
        live = [g for g in live if g.chosen]
        while live:
            levels = [g.member.level(g.chosen or [], cache.scratch) for g in live]
            out, at = self._level(live, levels)
            for g, level, first in zip(live, levels, at, strict=True):
                n = len(level.tokens)
                g.chosen = _next(g.growth, g.member.picker.pick(_rows(out, first, n), g.ctx, level.paths))
            live = [g for g in live if g.chosen]

    def _packs(self) -> bool:
        """Whether rows' blocks are packed (no padding: the linear layers see real tokens only) rather than
        padded to the widest row's. A lone row pads nothing (and keeps the native decoder, which takes
        [B, T] blocks); a draft that reads the target's activations keeps the padded layout, which its
        feature input reads."""
        return self.cache.batch_size > 1 and self.state.reader is None

    def _catch_up(self, drafting: Sequence[tuple[TreeMember, DraftContext]]) -> ModelOutput:
        """Every drafting member's pending tokens as a causal chain (packed, or padded to the longest);
        the output's rows are their roots, in `drafting`'s order."""
        cache, dev = self.cache, self.state.device
        counts = [0] * cache.batch_size
        for m, _ in drafting:
            counts[m.row] = len(m.pending)
        if self._packs():
            starts = list(itertools.accumulate(counts, initial=0))
            ids = torch.tensor([[t for m, _ in sorted(drafting, key=lambda d: d[0].row) for t in m.pending]])
            batch = row_blocks_batch(cache, [list(range(-1, n - 1)) for n in counts], "split")
        else:
            width = max(counts)
            starts = [r * width for r in range(cache.batch_size)]
            ids = torch.zeros(cache.batch_size, width, dtype=torch.long)
            for m, _ in drafting:
                ids[m.row, : len(m.pending)] = torch.tensor(m.pending)
            batch = build_batch(cache, width, n_valid=counts)
        index = torch.tensor([starts[m.row] + len(m.pending) - 1 for m, _ in drafting], device=dev)
        return self.state.forward(ids.to(dev), batch, index)

    def _level(self, live: Sequence[_Growing], levels: Sequence[Level]) -> tuple[ModelOutput, list[int]]:
        """One draft forward over every live member's level (packed, or padded to the widest); the output's
        rows are the members' nodes, and the index of each member's first."""
        cache, dev = self.cache, self.state.device
        rows = cache.batch_size
        blocks: list[_RowBlock | None] = [None] * rows  # by cache row
        for g, level in zip(live, levels, strict=True):
            trunk = len(g.member.pending)
            # its pending chain up to the root, its ancestors and itself; at the root's position + its depth
            blocks[g.member.row] = _RowBlock(scratch_tree_mask(level.slots, trunk, cache.scratch + len(level.tokens)),
                                             torch.tensor([len(s) for s in level.slots]) + trunk - 1, level.tokens)
        if self._packs():
            ids = torch.tensor([[t for b in blocks if b is not None for t in b.tokens]])
            batch = packed_append_batch(cache, [None if b is None else b.mask for b in blocks],
                                        [None if b is None else b.offsets for b in blocks])
            starts = list(itertools.accumulate((0 if b is None else len(b.tokens) for b in blocks), initial=0))
            return self.state.forward(ids.to(dev), batch, slice(None)), [starts[g.member.row] for g in live]
        t = max(len(level.tokens) for level in levels)
        width = cache.scratch + t
        mask = torch.zeros(rows, t, width, dtype=torch.bool)
        offsets = torch.zeros(rows, t, dtype=torch.long)
        ids = torch.zeros(rows, t, dtype=torch.long)
        n_valid = [0] * rows
        index: list[int] = []
        firsts: list[int] = []
        for r, b in enumerate(blocks):
            if b is not None:
                n = len(b.tokens)
                mask[r, :n, : cache.scratch + n] = b.mask
                offsets[r, :n], ids[r, :n], n_valid[r] = b.offsets, torch.tensor(b.tokens), n
        for g in live:
            r, n = g.member.row, n_valid[g.member.row]
            firsts.append(len(index))
            index.extend(range(r * t, r * t + n))
        batch = build_batch(cache, t, mask, offsets, n_valid, append=True)
        # a lone member's rows are all real: all its logits, no gather
        logit_rows = slice(None) if rows == 1 else torch.tensor(index, device=dev)
        return self.state.forward(ids.to(dev), batch, logit_rows), firsts


def _rows(out: ModelOutput, first: int, n: int) -> ModelOutput:
    """Rows first .. first + n - 1 of a forward's logits [1, N, V'], as a forward of their own."""
    return ModelOutput(out.logits[:, first : first + n], {}, out.vocab_ids)


def _next(growth: Growth, dists: NextTokens | None) -> list[int] | None:
    """The generator's next level (None: its tree is grown); `dists`: the last level's distributions."""
    try:
        return next(growth) if dists is None else growth.send(dists)
    except StopIteration:
        return None
