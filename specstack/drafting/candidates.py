"""The candidate tree both model drafters grow in a round, and the draft's picks of children.

Terms (staged paper, DESIGN §4):
- candidate: a token the draft proposes after the root (the last emitted token) or after another
  candidate. Its score is the cumulative draft probability of its path (the product of the draft's
  probabilities along it), so a child never outscores its parent.
- expanded: a candidate the draft has run; its keys/values sit in the draft's scratch at `slot`, and
  the forward's row for it gave its children.
- target batch: the best candidates by rank (`CandidateTree.best`), a prefix-closed set, sent to the
  target as a DraftTree (`CandidateTree.draft_tree`).
- children of a row: greedy, the draft's top-`width` tokens; sampling, `width` draws without
  replacement from the warped q (an exponential race over its positive columns), in draw order, as
  recursive rejection sampling expects.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstack.config import SamplingParams
from specstack.drafting.base import DraftContext
from specstack.models.base import ModelOutput
from specstack.sampling import argmax_rows, warp
from specstack.tree import DraftTree, Origin


@dataclass
class Candidate:
    token: int
    parent: int  # candidate index, -1 = the root
    score: float  # cumulative draft probability of the path
    q: torch.Tensor | None = None  # [V] the warped draft distribution it was drawn from; None: picked
    origin: Origin = "draft"
    slot: int = -1  # scratch slot once the draft has run this node (expanded), else -1

    @property
    def expanded(self) -> bool:
        return self.slot >= 0


class CandidateTree:
    """The candidates of one round, in creation order: a parent is always created before its
    children, so index order is topological."""

    def __init__(self) -> None:
        self.nodes: list[Candidate] = []
        self._kids: dict[int, list[int]] = {}  # candidate (-1: the root) -> its children, in creation order

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i: int) -> Candidate:
        return self.nodes[i]

    def add(self, token: int, parent: int, score: float, q: torch.Tensor | None = None,
            origin: Origin = "draft") -> int:
        self.nodes.append(Candidate(token, parent, score, q, origin))
        self._kids.setdefault(parent, []).append(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def add_children(self, parent: int, children: Sequence[tuple[int, float]], q: torch.Tensor | None) -> None:
        """The picked children (token, draft probability) of an expanded node (-1: the root), each
        scored by its path; a token already among the node's children is kept as it is."""
        base = self.score(parent)
        present = {self.nodes[c].token for c in self._kids.get(parent, [])}
        for tok, prob in children:
            if tok not in present:
                self.add(tok, parent, base * prob, q)

    def child(self, parent: int, token: int) -> int | None:
        """The child of `parent` (-1: the root) with this token, if there is one."""
        return next((c for c in self._kids.get(parent, []) if self.nodes[c].token == token), None)

    def score(self, i: int) -> float:
        """Cumulative draft probability of candidate i's path (1 for the root, -1)."""
        return 1.0 if i < 0 else self.nodes[i].score

    def path(self, i: int) -> list[int]:
        """Candidate ids from the root's child down to i (empty for the root); its length is i's depth."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.nodes[i].parent
        return path[::-1]

    def depth(self, i: int) -> int:
        d = 0
        while i >= 0:
            d, i = d + 1, self.nodes[i].parent
        return d

    def rank(self, i: int) -> float:
        """Selection key. A node carrying q (sampled for recursive rejection sampling) ranks by its
        parent's score, ties in draw order: whether it is kept must not depend on its own drawn token,
        or the kept children are no longer draws from q without replacement and RRS is biased."""
        c = self.nodes[i]
        return c.score if c.q is None else self.score(c.parent)

    def best(self, n: int) -> list[int]:
        """The n best candidates, best first (ties: older first). Prefix-closed for every n: a child
        never outranks its parent, and a sampled node's siblings keep their draw order."""
        return sorted(range(len(self.nodes)), key=lambda i: (-self.rank(i), i))[:n]

    def draft_tree(self, ids: Sequence[int]) -> DraftTree:
        """The candidates `ids` (prefix-closed, parents first) as the DraftTree sent to the target."""
        index = {c: n for n, c in enumerate(ids)}
        tree = DraftTree()
        for c in ids:
            cand = self.nodes[c]
            tree.add(cand.token, -1 if cand.parent < 0 else index[cand.parent], cand.origin, cand.q)
        return tree


def children_of(probs: torch.Tensor, width: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> list[list[tuple[int, float]]]:
    """(column, prob) of the children of every row of probs [T, V']. Greedy: the top-`width`
    columns. Sampling: `width` draws without replacement from each row, in draw order, as recursive
    rejection sampling expects. Zero-probability columns are never children.
    One call for the whole block: a staged step has tens of rows, and a call per row paid its
    dispatch for each (docs/bench-history, "Small costs behind the code's choices"); the probabilities
    come from one gather, not an index per child."""
    k = min(width, probs.shape[-1])
    if not sampling.greedy:
        return _drawn_children(probs, k, generator)
    if k == 1:  # a chain's step: the argmax through NumPy, a vectorised scan (torch.topk's is not)
        idx = torch.tensor(argmax_rows(probs), device=probs.device).unsqueeze(-1)
    else:
        idx = torch.topk(probs, k, dim=-1).indices
    return _listed(idx, probs.gather(-1, idx))


def _listed(idx: torch.Tensor, vals: torch.Tensor) -> list[list[tuple[int, float]]]:
    return [[(c, v) for c, v in zip(ri, rv, strict=True) if v > 0]
            for ri, rv in zip(idx.tolist(), vals.tolist(), strict=True)]


def _drawn_children(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> list[list[tuple[int, float]]]:
    """k draws without replacement from each row of probs [T, V'], in draw order: an exponential race
    (Efraimidis-Spirakis; the Gumbel top-k trick in another form): column c finishes at E_c / p_c with
    E_c ~ Exp(1), and the first k to finish are the draws. Only the columns of positive probability
    run: behind top-k or top-p they are a few of a 150k vocabulary, and a uniform draw per column was
    most of a draft step's picking."""
    if 4 * int((probs > 0).sum()) > probs.numel():  # mostly positive (temperature alone): every column runs
        u = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(min=1e-20)
        idx = torch.topk(probs / -u.log(), k, dim=-1).indices
        return _listed(idx, probs.gather(-1, idx))
    rows, cols = probs.nonzero(as_tuple=True)  # row-major: each row's columns together
    n = rows.numel()
    if n == 0:
        return [[] for _ in range(probs.shape[0])]
    p = probs[rows, cols]
    u = torch.rand(n, generator=generator, device=probs.device, dtype=torch.float64).clamp_(min=1e-300)
    speed = p.double() / -u.log()  # larger is sooner
    counts = torch.bincount(rows, minlength=probs.shape[0])
    starts = counts.cumsum(0) - counts
    width = int(counts.max())
    race = torch.full((probs.shape[0], width), -1.0, dtype=torch.float64, device=probs.device)
    at = torch.arange(n, device=probs.device) - starts[rows]
    race[rows, at] = speed
    column = torch.zeros((probs.shape[0], width), dtype=torch.long, device=probs.device)
    column[rows, at] = cols
    first = torch.topk(race, min(k, width), dim=-1).indices
    idx = column.gather(-1, first)
    vals = torch.where(race.gather(-1, first) > 0, probs.gather(-1, idx), torch.zeros((), dtype=probs.dtype))
    return _listed(idx, vals)


@dataclass(frozen=True)
class Columns:
    """The token each logits column scores. A draft with a reduced vocabulary (ModelOutput.vocab_ids)
    scores only its own tokens: softmax and top-k over 8k columns, not 49k."""

    vocab_size: int  # the target's vocabulary
    id_tensor: torch.Tensor | None = None  # the ids as the model returned them; None: column j is token j
    ids: list[int] | None = None
    index: dict[int, int] | None = None  # token id -> column

    @staticmethod
    def of(vocab_ids: torch.Tensor | None, vocab_size: int) -> Columns:
        if vocab_ids is None:
            return Columns(vocab_size)
        ids = vocab_ids.tolist()
        return Columns(vocab_size, vocab_ids, ids, {t: c for c, t in enumerate(ids)})

    def token(self, col: int) -> int:
        return col if self.ids is None else self.ids[col]

    def column(self, token: int) -> int | None:
        """The column scoring `token`; None for a token outside the draft's vocabulary."""
        return token if self.index is None else self.index.get(token)


@dataclass
class NextTokens:
    """The draft's next-token distributions for the rows of one forward, over the logits' columns.
    Greedy targets rank children by the draft's softmax; sampling targets use the warped q."""

    probs: torch.Tensor  # [T, V'] fp32
    columns: Columns
    kids: list[list[tuple[int, float]]]  # per row: its children's (column, prob), in draw order (children_of)
    _full: torch.Tensor | None = None

    def children(self, row: int) -> list[tuple[int, float]]:
        """(token, prob) of the row's children."""
        return [(self.columns.token(c), prob) for c, prob in self.kids[row]]

    def best(self, row: int) -> int:
        """The row's most likely token (its first child when greedy)."""
        return self.columns.token(int(self.probs[row].argmax()))

    def prob(self, row: int, token: int) -> float:
        col = self.columns.column(token)
        return 0.0 if col is None else float(self.probs[row, col])

    def q(self, row: int) -> torch.Tensor:
        """The row's q over the whole vocabulary [V] (0 outside the draft's tokens), for verification."""
        if self.columns.ids is None:
            return self.probs[row]
        if self._full is None:
            self._full = self.probs.new_zeros(self.probs.shape[0], self.columns.vocab_size)
            self._full[:, self.columns.id_tensor] = self.probs
        return self._full[row]


class ChildPicker:
    """Turns a draft forward into NextTokens: the distribution of each row (the draft's softmax when
    greedy, the target's warp of it under sampling) and each row's `width` children."""

    def __init__(self, width: int, vocab_size: int) -> None:
        self.width = width
        self._columns = Columns(vocab_size)

    def pick(self, out: ModelOutput, ctx: DraftContext, paths: Sequence[Sequence[int]] | None = None) -> NextTokens:
        """out: a forward of one row (logits [1, T, V']); paths[t]: the tokens after the root that position
        t follows (None: every position is the root), for the request's logits rule."""
        logits = out.logits[0]
        if ctx.rule is not None:
            logits = ctx.rule(logits, paths if paths is not None else [()] * logits.shape[0], out.vocab_ids)
        probs = torch.softmax(logits.float(), -1) if ctx.sampling.greedy else warp(logits, ctx.sampling)
        if ctx.rule is not None:  # a row the rule refuses whole (no allowed token among the draft's) has no children
            probs = probs.nan_to_num_(0.0)
        if out.vocab_ids is not self._columns.id_tensor:  # map the draft's columns once, not every forward
            self._columns = Columns.of(out.vocab_ids, self._columns.vocab_size)
        kids = children_of(probs, self.width, ctx.sampling, ctx.generator)
        return NextTokens(probs, self._columns, kids)
