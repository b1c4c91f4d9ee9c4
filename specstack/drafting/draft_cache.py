"""A draft model's KV cache with a row per sequence it drafts for, and what each row has not run yet:
the state a group of model drafters keeps (drafting/batched_tree.py: a row per member; a lone drafter is
a group of one). Every draft forward goes through `forward`, which counts them (a
step's draft forwards: engine/stats.py BatchStep.draft_forwards); `read_ahead` runs long pending chains
(a prompt) packed before a round, so that the round's padded catch-up stays short.

Per row, the cache holds the committed context except the tokens the draft has not run yet (`pending`:
at least the root, the last emitted token). A round runs, in the cache's scratch, the pending tokens
(catch-up) and then drafted nodes; `observe` commits the pending tokens plus the accepted nodes that
the draft ran (their keys/values were computed with exactly their accepted ancestors), so no token is
ever run twice: the accepted nodes it did not run, and the target's next token, become pending. After
a round that ran no draft forward (nothing would be verified) the pending tokens wait for the next.

A draft that reads the target's activations (SPIRe, models/base.py ReadsTargetActivations) never runs
verified tokens: `reset` and `observe` queue them with the target's hidden states, and
`write_memories` writes every row's queue into the cache, one packed write, before the next round.

With a prefix cache (prefix_cache.py, the draft's own: its keys and values are not the target's)
a row reset with a prompt copies the longest cached prefix of it and runs only the rest; a row's
committed tokens are stored after its first round (the prompt: for the n samples of one prompt and the
requests that follow) and when it is reset for its next sequence (prompt and answer: a chat's next turn).
A draft with a sliding window or one that reads the target's activations keeps none (its slots are not
its positions, or its memories are not its own keys): it reads its prompt.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specstack.attention import AttentionBatch, row_blocks_batch
from specstack.config import WindowSpec
from specstack.models.base import LoadedModel, ModelOutput, ReadsTargetActivations
from specstack.prefix_cache import PrefixCache
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


class DraftCache:
    def __init__(self, draft: LoadedModel, capacity: int, window: WindowSpec | None = None,
                 prefix: PrefixCache | None = None) -> None:
        model = self.model = draft.model
        self.device = model.device
        self.forwards = 0  # the draft's forwards so far (`forward`): what a step's drafting cost, counted
        # grown as its rows read (up to `capacity`): a row holds what it read, not the draft's whole context
        self.cache = model.new_cache(0, None, window, max_rows=1, max_capacity=capacity)
        # the one check of the capability (a SPIRe draft built without target activations has it, but
        # reads no layer: it runs every token itself, like any other draft)
        reader = model if isinstance(model, ReadsTargetActivations) and model.target_hidden_layers else None
        self.reader: ReadsTargetActivations | None = reader
        self.target_layers: tuple[int, ...] = tuple(reader.target_hidden_layers) if reader is not None else ()
        self.pending: list[list[int]] = []  # per row
        self.ran: list[bool] = []  # per row: its last round ran the draft
        # verified tokens (and their target activations [T, L, d]) whose memories a reader still has to write
        self._memories: dict[int, tuple[list[int], torch.Tensor]] = {}
        self.prefix = prefix if window is None and reader is None else None
        self.committed: list[list[int]] = []  # per row, with a prefix cache: the tokens its committed slots hold
        self._stored: list[bool] = []  # per row: its prompt is in the prefix cache

    def add_row(self) -> int:
        """A new row (the cache grows by doubling); returns its index."""
        if self.cache.batch_size >= self.cache.max_rows:
            self.cache.reserve(2 * self.cache.max_rows)
        self.pending.append([])
        self.ran.append(True)
        self.committed.append([])
        self._stored.append(True)
        return self.cache.add_row()

    def reset(self, row: int, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None) -> None:
        self._store(row)  # the sequence it ran before
        self.cache.reset(row)
        self._memories.pop(row, None)
        self.pending[row], self.ran[row] = list(prompt_ids), True
        if self.reader is not None:  # the target's prefill gave the memories of all but the root
            self._remember(row, self.pending[row][:-1], target_hidden)
            self.pending[row] = self.pending[row][-1:]
        if self.prefix is not None:  # run only what the cache does not hold (the root always)
            match = self.prefix.match(prompt_ids, len(prompt_ids) - 1)
            self.prefix.use(match)
            if match.tokens:
                self.cache.load_prefix(row, match.pieces())
            self.pending[row] = list(prompt_ids[match.tokens:])
            self.committed[row], self._stored[row] = list(prompt_ids[: match.tokens]), False

    def forward(self, ids: torch.Tensor, batch: AttentionBatch, logit_rows: slice | torch.Tensor) -> ModelOutput:
        """One forward of the draft over this cache (every draft forward goes through here: it is counted)."""
        self.forwards += 1
        return self.model.forward(ids, batch, self.cache, logit_rows=logit_rows)

    def read_ahead(self, rows: Sequence[int]) -> None:
        """Rows `rows` run all their pending tokens but the root now, packed (each row writes only its own
        tokens), and commit them: a long pending chain (a prompt, after reset) is not padded into every
        row's catch-up, which stays short (and within the scratch a round may write)."""
        if not rows:
            return
        rows = sorted(rows)  # packed: row 0's tokens first
        parents: list[list[int]] = [[] for _ in range(self.cache.batch_size)]
        for r in rows:
            parents[r] = list(range(-1, len(self.pending[r]) - 2))
        ids = torch.tensor([[t for r in rows for t in self.pending[r][:-1]]], device=self.device)
        batch = row_blocks_batch(self.cache, parents, "split")
        self.forward(ids, batch, torch.zeros(0, dtype=torch.long, device=self.device))
        self.cache.commit_prefix([len(p) for p in parents])
        for r in rows:
            self._ran_ahead(r, len(self.pending[r]) - 1)

    def allow(self, slots: int) -> None:
        """Rows may grow to `slots` slots (a member joining a group says what its rounds' scratch needs)."""
        self.cache.max_capacity = max(self.cache.max_capacity, slots)

    def _ran_ahead(self, row: int, n: int) -> None:
        """The row's first n pending tokens were run and committed outside a round (read_ahead)."""
        if self.prefix is not None:
            self.committed[row] += self.pending[row][:n]
        self.pending[row] = self.pending[row][n:]

    def _store(self, row: int) -> None:
        """Row's committed tokens into the prefix cache."""
        kv = self.cache.committed_kv(row) if self.prefix is not None else None
        if kv is None or self.prefix is None or len(self.committed[row]) != self.cache.lengths[row]:
            return
        self.prefix.store(self.committed[row], *kv)
        self._stored[row] = True

    def _remember(self, row: int, tokens: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[1] != len(tokens):
            raise ValueError(f"this draft needs the target's hidden states of {len(tokens)} verified tokens")
        if tokens:
            old_tokens, old_hidden = self._memories.get(row, ([], hidden[0, :0]))
            self._memories[row] = (old_tokens + tokens, torch.cat([old_hidden, hidden[0]]))

    def write_memories(self) -> None:
        """Every row's queued verified tokens into the cache from the target's activations."""
        if not self._memories:
            return
        rows = [r for r in range(self.cache.batch_size) if r in self._memories]
        counts = [len(self._memories[r][0]) if r in self._memories else 0 for r in range(self.cache.batch_size)]
        tokens = torch.tensor([[t for r in rows for t in self._memories[r][0]]], device=self.device)
        hidden = torch.cat([self._memories[r][1] for r in rows]).unsqueeze(0)
        self._memories = {}
        assert self.reader is not None  # only a reader keeps memories to write
        self.reader.write_memories(tokens, hidden, self.cache, counts)

    def observe(self, row: int, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None,
                slot: Callable[[int], int]) -> None:
        """The target accepted result.accepted of `tree` and emitted result.tokens (the accepted nodes,
        any a grammar forced below them, the target's token). slot(node): the scratch slot in which this
        round's draft ran accepted node `node`, or -1 if it did not run it. target_hidden
        [1, len(result.tokens), L, d]: the target's hidden states of the root and every emitted token but
        the last, for a reader."""
        pending = self.pending[row]
        if self.reader is not None:  # root and emitted path stored from the target's activations
            self._remember(row, pending + result.tokens[:-1], target_hidden)
            self.pending[row] = [result.next_token]
            return
        if not self.ran[row]:  # the round ran no draft forward: the emitted tokens join the pending ones
            pending.extend(result.tokens)
            return
        keep = list(range(len(pending)))
        for node in result.accepted:
            if slot(node) < 0:
                break  # an accepted node the draft never ran: it becomes pending, and so do those after it
            keep.append(slot(node))
        self.cache.commit_nodes(row, keep)
        if self.prefix is not None:
            self.committed[row] += pending + [tree.tokens[n] for n in result.accepted[: len(keep) - len(pending)]]
            if not self._stored[row]:  # its prompt is in: for the next rows of the same prompt
                self._store(row)
        # what it did not run: accepted nodes past those it ran, then the emitted tokens past its tree (the
        # target's, and a grammar's forced tokens the engine hung below it)
        self.pending[row] = result.tokens[len(keep) - len(pending):]
