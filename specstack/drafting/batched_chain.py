"""Chains from one draft model for many rows at once (BASS, DESIGN §6): one draft forward per draft
step for every row of a batch.

Terms. A `ChainGroup` owns the draft's KV cache with one row per member; a member (`ChainRow`) is the
drafter of one row of the engine (drafting/base.py's Drafter), and names its group in `group`, so the
batched engine asks the group for all of its members' chains together (`propose_rows`). With a single
member (one sequence) it is an ordinary drafter.

State per member, as for ModelDrafter (drafting/model.py): the draft's cache holds the committed
context except the tokens it has not run yet (`pending`: at least the root, the last emitted token). A
round, for the members that propose:
  1. catch-up: every member's pending tokens as a causal chain, padded to the longest (PAD layout,
     attention.build_batch with n_valid); the last real row of each is the root's next-token
     distribution;
  2. draft steps 1 .. k - 1: one token a member (the one just drafted), appended to the round's
     scratch; a member sees its own pending slots, its own drafted slots and itself, never another
     member's (the mask) — members whose chain is done sit the step out (n_valid 0);
  3. each member's chain as a DraftTree: tokens drawn greedily (the argmax) or from the warped q of its
     own sampling parameters and generator (nodes carry q: recursive rejection sampling verifies them);
     a greedy chain's nodes carry their cumulative draft probability as `confidence`.
`observe` commits a member's pending tokens plus the accepted nodes the draft ran (slot = catch-up
width + node index), so no token is run twice. A draft that reads the target's activations (SPIRe)
never runs verified tokens: their memories are written from the target's hidden states, for every
member at once, before the next round (`write_memories` with per-row counts).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specstack.attention import build_batch, row_blocks_batch
from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext
from specstack.drafting.candidates import ChildPicker
from specstack.models.base import LoadedModel, ModelOutput, ReadsTargetActivations
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


class ChainGroup:
    """The shared part: the draft model, its cache (a row per member) and the batched rounds."""

    def __init__(self, draft: LoadedModel, k: int, window: WindowSpec | None = None) -> None:
        if k < 1:
            raise ValueError(f"a chain needs k >= 1, got {k}")
        self.draft, self.k, self.window = draft, k, window
        model = draft.model
        # the context, plus one round's scratch past a row's committed tokens: a catch-up padded to the
        # longest pending chain (at most k + 1 once a row has started) and k - 1 drafted tokens
        self.capacity = draft.config.max_seq_len + 2 * k + 4
        self.cache = model.new_cache(0, self.capacity, window, max_rows=1)
        reads = isinstance(model, ReadsTargetActivations) and bool(model.target_hidden_layers)
        self.reader: ReadsTargetActivations | None = model if reads else None
        self.target_layers: tuple[int, ...] = tuple(model.target_hidden_layers) if reads else ()
        self.members: list[ChainRow] = []
        self.picker = ChildPicker(1, draft.config.vocab_size)
        # verified tokens (and their target activations [T, L, d]) whose memories a reader still has to write
        self._memories: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._width = 0  # this round's catch-up width (the slot of a row's first drafted node)

    def member(self) -> ChainRow:
        """A new member with a row of its own (the cache grows by doubling)."""
        row = len(self.members)
        if row >= self.cache.max_rows:
            self.cache.reserve(2 * self.cache.max_rows)
        self.cache.add_row()
        m = ChainRow(self, row)
        self.members.append(m)
        return m

    # -- a member's sequence ------------------------------------------------------------------------
    def reset_row(self, m: ChainRow, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None) -> None:
        self.cache.reset(m.row)
        self._memories.pop(m.row, None)
        m.pending, m.ran = list(prompt_ids), 0
        if self.reader is not None:  # the target's prefill gave the memories of all but the root
            self._remember(m, m.pending[:-1], target_hidden)
            m.pending = m.pending[-1:]

    def _remember(self, m: ChainRow, tokens: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[1] != len(tokens):
            raise ValueError(f"this draft needs the target's hidden states of {len(tokens)} verified tokens")
        if tokens:
            old_tokens, old_hidden = self._memories.get(m.row, ([], hidden[0, :0]))
            self._memories[m.row] = (old_tokens + tokens, torch.cat([old_hidden, hidden[0]]))

    def _write_memories(self) -> None:
        """Every member's verified tokens into the cache from the target's activations, one packed write."""
        if not self._memories:
            return
        rows = range(self.cache.batch_size)
        counts = [len(self._memories[r][0]) if r in self._memories else 0 for r in rows]
        dev = self.draft.model.device
        tokens = torch.tensor([[t for r in rows if r in self._memories for t in self._memories[r][0]]], device=dev)
        hidden = torch.cat([self._memories[r][1] for r in rows if r in self._memories]).unsqueeze(0)
        self._memories = {}
        self.reader.write_memories(tokens, hidden, self.cache, counts)

    def _prefill(self, members: Sequence[ChainRow]) -> None:
        """Members whose pending chain is long (a prompt, after reset) read all of it but the root first,
        packed (each row writes only its own tokens), so a round's padded catch-up stays short."""
        long = [m for m in members if len(m.pending) > self.k + 1]
        if not long:
            return
        parents = [[] for _ in range(self.cache.batch_size)]
        for m in long:
            parents[m.row] = list(range(-1, len(m.pending) - 2))
        model = self.draft.model
        ids = torch.tensor([[t for m in sorted(long, key=lambda m: m.row) for t in m.pending[:-1]]], device=model.device)
        batch = row_blocks_batch(self.cache, parents, "split")
        model.forward(ids, batch, self.cache, logit_rows=torch.zeros(0, dtype=torch.long, device=model.device))
        self.cache.commit_prefix([len(p) for p in parents])
        for m in long:
            m.pending = m.pending[-1:]

    def observe_row(self, m: ChainRow, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None) -> None:
        if self.reader is not None:  # root and accepted path stored from the target's activations
            rows = [0] + [a + 1 for a in result.accepted]
            self._remember(m, m.pending + [tree.tokens[a] for a in result.accepted],
                           None if target_hidden is None else target_hidden[:, rows])
            m.pending = [result.next_token]
            return
        if not m.ran:  # the round ran nothing for this row: the emitted token joins the pending ones
            m.pending.append(result.next_token)
            return
        run = min(len(result.accepted), m.ran - 1)  # accepted nodes the draft ran (all but the last drafted)
        keep = list(range(len(m.pending))) + [self._width + i for i in range(run)]
        self.cache.commit_nodes(m.row, keep)
        m.pending = [tree.tokens[a] for a in result.accepted[run:]] + [result.next_token]

    # -- a round ------------------------------------------------------------------------------------
    def propose_rows(self, members: Sequence[ChainRow], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Every member's chain (members of this group, each with its row's context), drafted together."""
        self._write_memories()
        model, cache = self.draft.model, self.cache
        dev = model.device
        for m, ctx in zip(members, ctxs, strict=True):
            m.length = self.k if ctx.limit is None else max(0, min(self.k, ctx.limit))
            # every drafted token but the last is run: its position must stay within the draft's context
            room = self.draft.config.max_seq_len - (cache.next_pos[m.row] + len(m.pending))
            m.length = min(m.length, max(0, room + 1))
            # nothing will be verified: no draft forward, the pending tokens wait (up to a bound, so the
            # next catch-up stays short); a reader's pending token is the root alone and never waits long
            m.ran = 0 if m.length == 0 and len(m.pending) <= self.k else max(1, m.length)
        active = [(m, ctx) for m, ctx in zip(members, ctxs, strict=True) if m.ran]
        trees = {m.row: DraftTree() for m in members}
        if not active:
            return [trees[m.row] for m in members]
        self._prefill([m for m, _ in active])
        rows = cache.batch_size
        # 1. catch-up, padded to the longest pending chain
        counts = [0] * rows
        for m, _ in active:
            counts[m.row] = len(m.pending)
        width = max(counts)
        self._width = width
        tokens = torch.zeros(rows, width, dtype=torch.long, device=dev)
        for m, _ in active:
            tokens[m.row, : len(m.pending)] = torch.tensor(m.pending, device=dev)
        index = torch.tensor([m.row * width + len(m.pending) - 1 for m, _ in active], device=dev)
        out = model.forward(tokens, build_batch(cache, width, n_valid=counts), cache, logit_rows=index)
        drafted: dict[int, list[int]] = {m.row: [] for m, _ in active}
        self._draw(active, out, trees, drafted)
        # 2. draft steps: each member runs its last drafted token, while its chain is short of its length
        for step in range(1, max(m.length for m, _ in active)):
            going = [(m, ctx) for m, ctx in active if m.length > step]
            if not going:
                break
            prior = cache.scratch
            mask = torch.zeros(rows, 1, prior + 1, dtype=torch.bool)
            offsets = torch.zeros(rows, 1, dtype=torch.long)
            n_valid = [0] * rows
            ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
            for m, _ in going:
                n = len(m.pending)
                mask[m.row, 0, :n] = True  # its pending chain
                mask[m.row, 0, width : width + step - 1] = True  # its drafted tokens run before
                offsets[m.row, 0] = n + step - 1  # d_step sits one past the root, step - 1 further
                n_valid[m.row] = 1
                ids[m.row, 0] = drafted[m.row][-1]
            batch = build_batch(cache, 1, mask, offsets, n_valid, append=True)
            index = torch.tensor([m.row for m, _ in going], device=dev)
            out = model.forward(ids, batch, cache, logit_rows=index)
            self._draw(going, out, trees, drafted)
        return [trees[m.row] for m in members]

    def _draw(self, rows: Sequence[tuple[ChainRow, DraftContext]], out: ModelOutput, trees: dict[int, DraftTree],
              drafted: dict[int, list[int]]) -> None:
        """The next node of each row's chain from its row of `out` (logits [1, len(rows), V'])."""
        for j, (m, ctx) in enumerate(rows):
            if len(drafted[m.row]) >= m.length:
                continue  # a row that must only catch up
            nxt = self.picker.pick(ModelOutput(out.logits[:, j : j + 1], {}, out.vocab_ids), ctx)
            kids = nxt.children(0)
            if not kids:
                m.length = len(drafted[m.row])  # the draft gives no token (all of q outside the target's)
                continue
            token, prob = kids[0]
            tree = trees[m.row]
            greedy = ctx.sampling.greedy
            score = (tree.confidence[-1] if len(tree) else 1.0) * prob if greedy else None
            tree.add(token, len(tree) - 1, "draft", None if greedy else nxt.q(0), score)
            drafted[m.row].append(token)


class ChainRow:
    """One row's drafter in a ChainGroup (drafting/base.py's Drafter)."""

    def __init__(self, group: ChainGroup, row: int) -> None:
        self.group, self.row = group, row
        self.target_layers = group.target_layers
        self.pending: list[int] = []
        self.length = 0  # nodes this round's chain may have
        self.ran = 0  # this round's chain length as drafted (0: the round ran nothing for it)

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.group.reset_row(self, prompt_ids, target_hidden)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.group.propose_rows([self], [ctx])[0]

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        self.group.observe_row(self, tree, result, target_hidden)

