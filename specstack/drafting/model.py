"""Model drafter: a small LM (sharing the target's tokenizer) proposes a chain or a best-first tree.

State: the draft's KV cache holds the committed context except the tokens it has not run yet
(`pending`: at least the root, the last emitted token). A round runs, in the draft's scratch:
  1. the pending tokens as a causal chain (catch-up; its last row is the root's distribution),
  2. then, level by level, the best unexpanded nodes of the tree as one tree block each.
`observe` commits the pending tokens plus the accepted nodes that the draft ran (their keys/values
were computed with exactly their accepted ancestors), so no token is ever run twice.

Tree (staged paper, DESIGN §4): candidates scored by cumulative draft probability; the target batch
is the `budget` best (a prefix-closed set: a child never outscores its parent). Greedy target: the
top-`width` children of each expanded node. Sampling target: `width` children drawn from the warped q
without replacement (Gumbel top-k), so recursive rejection sampling can use q; the budget then ranks
a sampled node by its parent's score (`_rank`), keeping each node's children as a prefix of their
draw order: keeping the likeliest draws instead would bias RRS.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstack.attention import build_batch
from specstack.config import SamplingParams, WindowSpec
from specstack.drafting.base import DraftContext
from specstack.drafting.draft_length import CostAwareBudget
from specstack.errors import SpecstackError
from specstack.models.loading import LoadedModel
from specstack.models.transformer import ModelOutput
from specstack.sampling import warp
from specstack.tree import DraftTree, Origin
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


@dataclass
class _Candidate:
    token: int
    parent: int  # candidate index, -1 = root
    score: float  # cumulative draft probability of the path
    q: torch.Tensor | None
    origin: Origin = "draft"
    slot: int = -1  # scratch index once the draft has run this node (expanded), else -1


def children_of(probs: torch.Tensor, width: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> list[list[tuple[int, float]]]:
    """(column, prob) of the children of every row of probs [T, V']. Greedy: the top-`width`
    columns. Sampling: `width` draws without replacement from each row (Gumbel top-k), in draw
    order, as recursive rejection sampling expects. Zero-probability columns are never children.
    One top-k call for the whole block: per-row calls cost 0.16 ms each at 49k columns, ~80 rows a
    staged step; the probabilities come from one gather, not an index per child."""
    k = min(width, probs.shape[-1])
    if sampling.greedy:
        idx = torch.topk(probs, k, dim=-1).indices
    else:
        u = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(1e-20, 1.0)
        idx = torch.topk(probs.log() - (-u.log()).log(), k, dim=-1).indices
    vals = probs.gather(-1, idx)
    return [[(c, v) for c, v in zip(ri, rv) if v > 0] for ri, rv in zip(idx.tolist(), vals.tolist())]


@dataclass
class NextTokens:
    """The draft's next-token distributions for the rows of one forward, over the logits' columns (a
    draft with a reduced vocabulary scores only its own tokens: softmax and top-k over 8k columns,
    not 49k). Greedy targets rank children by the draft's softmax; sampling targets use the warped q."""

    probs: torch.Tensor  # [T, V'] fp32
    ids: list[int] | None  # token id of each column; None: column j is token j
    cols: dict[int, int] | None  # token id -> column (None with ids None)
    id_tensor: torch.Tensor | None  # ids as the model returned them (to spread q over the vocabulary)
    vocab_size: int
    kids: list[list[tuple[int, float]]]  # per row: its children's (column, prob), in draw order (children_of)
    _full: torch.Tensor | None = None

    def token(self, col: int) -> int:
        return col if self.ids is None else self.ids[col]

    def children(self, row: int) -> list[tuple[int, float]]:
        """(token, prob) of the row's top-`width` children."""
        return [(self.token(c), prob) for c, prob in self.kids[row]]

    def best(self, row: int) -> int:
        """The row's most likely token (its first child when greedy)."""
        return self.token(int(self.probs[row].argmax()))

    def prob(self, row: int, token: int) -> float:
        col = token if self.cols is None else self.cols.get(token)
        return 0.0 if col is None else float(self.probs[row, col])

    def q(self, row: int) -> torch.Tensor:
        """The row's q over the whole vocabulary (0 outside the draft's tokens), for verification."""
        if self.ids is None:
            return self.probs[row]
        if self._full is None:
            self._full = self.probs.new_zeros(self.probs.shape[0], self.vocab_size)
            self._full[:, self.id_tensor] = self.probs
        return self._full[row]


class ModelDrafter:
    # Under sampling, sampled children carry the draft's q and a tree of them is verified by recursive
    # rejection sampling. A subclass whose trees are verified by sample-walk sets this False.
    carries_q = True

    def __init__(self, draft: LoadedModel, params: TreeParams, capacity: int | None = None,
                 window: WindowSpec | None = None, budget: CostAwareBudget | None = None) -> None:
        """window: a sliding-window KV for the draft (MagicDec: the target itself as its own draft).
        budget: verify each step only the nodes that pay for their width (at most params.budget);
        it sizes trees of deterministic proposals only (see CostAwareBudget), else params.budget holds."""
        self.draft = draft
        self.params = params
        self.budget = budget
        self.capacity = capacity
        cap = capacity or draft.config.max_seq_len + self._scratch_bound()
        self.cache = draft.model.new_cache(1, cap, window) if window else draft.model.new_cache(1, cap)
        # a draft that reads the target's activations (SPIRe) never runs verified tokens itself
        self.target_layers: tuple[int, ...] = tuple(draft.model.target_hidden_layers)
        self.pending: list[int] = []
        self._cands: list[_Candidate] = []
        self._kids: dict[int, list[int]] = {}  # candidate -> its children candidates
        self._tree_ids: list[int] = []  # candidate index of each node in the proposed tree
        self._sized = False  # this step's tree is sized by `budget`
        self._t0 = 0.0  # when this step's proposal began
        self._vocab_src: torch.Tensor | None = None  # a reduced-vocabulary draft's column ids, mapped
        self._vocab: list[int] = []
        self._cols: dict[int, int] = {}

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        self.cache.reset()
        if self.budget is not None:
            self.budget.reset()
        self.pending = list(prompt_ids)
        if self.target_layers:  # the target's prefill gave the memories of all but the root
            self._remember(self.pending[:-1], target_hidden)
            self.pending = self.pending[-1:]

    def _remember(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[1] != len(tokens):
            raise ValueError(f"this draft needs the target's hidden states of {len(tokens)} verified tokens")
        if tokens:
            ids = torch.tensor([tokens], device=self.draft.model.device)
            self.draft.model.write_memories(ids, hidden, self.cache)

    # -- proposing --------------------------------------------------------------------------------
    def _next_tokens(self, out: ModelOutput, ctx: DraftContext) -> NextTokens:
        """The distributions of a forward's rows and each row's children."""
        logits = out.logits[0]
        probs = torch.softmax(logits.float(), -1) if ctx.sampling.greedy else warp(logits, ctx.sampling)
        ids, cols = None, None
        if out.vocab_ids is not None:
            if out.vocab_ids is not self._vocab_src:  # map the draft's columns once, not every forward
                self._vocab_src = out.vocab_ids
                self._vocab = out.vocab_ids.tolist()
                self._cols = {t: c for c, t in enumerate(self._vocab)}
            ids, cols = self._vocab, self._cols
        kids = children_of(probs, self.params.width, ctx.sampling, ctx.generator)
        return NextTokens(probs, ids, cols, out.vocab_ids, self.draft.config.vocab_size, kids)

    def _add_children(self, parent: int, dists: NextTokens, row: int, ctx: DraftContext) -> None:
        """Add the top-`width` children of an expanded node (tokens already there are kept as they are)."""
        base = 1.0 if parent < 0 else self._cands[parent].score
        q = None if ctx.sampling.greedy or not self.carries_q else dists.q(row)
        present = {self._cands[c].token for c in self._kids.get(parent, [])}
        for tok, prob in dists.children(row):
            if tok not in present:
                self._new(_Candidate(tok, parent, base * prob, q))

    def _new(self, cand: _Candidate) -> int:
        self._cands.append(cand)
        self._kids.setdefault(cand.parent, []).append(len(self._cands) - 1)
        return len(self._cands) - 1

    def _child(self, parent: int, token: int) -> int | None:
        return next((c for c in self._kids.get(parent, []) if self._cands[c].token == token), None)

    def _scratch_bound(self) -> int:
        """Most scratch slots one round can write: the pending tokens (at most an accepted path and
        the bonus token) plus every node expanded."""
        return self.params.depth + 2 + self.params.budget

    def _max_run_depth(self) -> int:
        """Deepest node the draft may run: its children stay within `depth`, and its position
        (root position + depth) within the draft's context."""
        room = self.draft.config.max_seq_len - (self.cache.next_pos[0] + len(self.pending))
        return min(self.params.depth - 1, room)

    def _rank(self, i: int) -> float:
        """Selection key. A node carrying q (sampled for recursive rejection sampling) ranks by its
        parent's score, ties in draw order: whether it is kept must not depend on its own drawn token,
        or the kept children are no longer draws from q without replacement and RRS is biased."""
        c = self._cands[i]
        if c.q is None:
            return c.score
        return 1.0 if c.parent < 0 else self._cands[c.parent].score

    def _selected(self) -> list[int]:
        """Candidate ids of the target batch: the `budget` best (or as many of them as pay, for a
        sized tree), parents before children."""
        order = sorted(range(len(self._cands)), key=lambda i: (-self._rank(i), i))[: self.params.budget]
        if self._sized:
            n = self.budget.choose([self._cands[i].score for i in order], time.perf_counter() - self._t0)
            order = order[:n]
        return sorted(order)

    def _depth(self, i: int) -> int:
        d = 0
        while i >= 0:
            d, i = d + 1, self._cands[i].parent
        return d

    def _run(self, chosen: list[int], ctx: DraftContext) -> NextTokens:
        """One draft forward over candidates `chosen` (topologically ordered; each one's parent is
        expanded already or earlier in `chosen`), appended to this round's scratch. Row j of the
        result is the next-token distribution after chosen[j]."""
        model = self.draft.model
        scratch = self.cache.scratch
        for j, i in enumerate(chosen):
            self._cands[i].slot = scratch + j
        mask = torch.zeros(len(chosen), scratch + len(chosen), dtype=torch.bool)
        mask[:, : len(self.pending)] = True  # every node sees the pending chain up to the root
        for j, i in enumerate(chosen):
            a = i
            while a >= 0:  # ...its expanded ancestors, and itself
                mask[j, self._cands[a].slot] = True
                a = self._cands[a].parent
        offsets = torch.tensor([self._depth(i) for i in chosen], device=model.device) + len(self.pending) - 1
        toks = torch.tensor([[self._cands[i].token for i in chosen]], device=model.device)
        batch = build_batch(self.cache, len(chosen), mask, offsets, append=True)
        return self._next_tokens(model.forward(toks, batch, self.cache), ctx)

    def propose(self, ctx: DraftContext) -> DraftTree:
        model = self.draft.model
        self._t0 = time.perf_counter()
        self._sized = self.budget is not None and (ctx.sampling.greedy or not self.carries_q)
        self._cands, self._kids = [], {}
        # 1. catch up on the pending tokens (the last one is the root): only the root's row is scored
        pend = torch.tensor([self.pending], device=model.device)
        out = model.forward(pend, build_batch(self.cache, len(self.pending)), self.cache,
                            logit_rows=slice(-1, None))
        # 2. grow the candidate tree
        self._grow(self._next_tokens(out, ctx), ctx)
        # 3. the target batch as a DraftTree
        self._tree_ids = self._selected()
        index = {c: n for n, c in enumerate(self._tree_ids)}
        tree = DraftTree()
        for c in self._tree_ids:
            cand = self._cands[c]
            tree.add(cand.token, -1 if cand.parent < 0 else index[cand.parent], cand.origin, cand.q)
        return tree

    def _grow(self, root: NextTokens, ctx: DraftContext) -> None:
        """Best-first: expand the best unexpanded nodes of the would-be target batch, a level of
        `expand_per_forward` nodes per draft forward, until none is left within the depth.
        root: the catch-up forward's distribution after the root (one row)."""
        p = self.params
        # a node of depth d runs at the root's position + d, which must stay inside the context
        max_depth = self._max_run_depth()
        self._add_children(-1, root, 0, ctx)
        while True:
            open_nodes = [i for i in self._selected() if self._cands[i].slot < 0 and self._depth(i) <= max_depth]
            chosen = sorted(open_nodes, key=lambda i: -self._cands[i].score)[: p.expand_per_forward]
            if not chosen:
                return
            chosen.sort()  # topological order within the block
            dists = self._run(chosen, ctx)
            for row, i in enumerate(chosen):
                self._add_children(i, dists, row, ctx)

    # -- feedback ---------------------------------------------------------------------------------
    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        """target_hidden [1, 1 + len(tree), L, d]: the target's hidden states of root + tree (rows as
        scored), for a draft with target_layers."""
        if self._sized:
            self.budget.observe([self._cands[c].score for c in self._tree_ids], len(result.accepted))
        if self.target_layers:  # root and accepted path stored from the target's activations
            rows = [0] + [a + 1 for a in result.accepted]
            self._remember(self.pending + [tree.tokens[a] for a in result.accepted],
                           None if target_hidden is None else target_hidden[:, rows])
            self.pending = [result.next_token]
            return
        keep = list(range(len(self.pending)))
        run = []
        for node in result.accepted:
            slot = self._cands[self._tree_ids[node]].slot
            if slot < 0:
                break  # an accepted leaf the draft never ran: it becomes pending
            run.append(node)
            keep.append(slot)
        self.cache.commit_nodes(0, keep)
        self.pending = [tree.tokens[n] for n in result.accepted[len(run):]] + [result.next_token]
