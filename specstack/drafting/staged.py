"""Staged drafter (Spector & Ré 2023, DESIGN §4): the draft model's own decoding is speculated by
draft2 (the n-gram model), and the same draft forwards grow the target's tree.

Round, after the catch-up forward that gives the root's draft distribution:
  the draft's greedy *spine* starts at the root. Repeatedly:
  1. the next spine token is the draft's argmax at the spine end;
  2. draft2 proposes a tree under it (widths 12, 7, 4, 1, 1, 1 in the paper);
  3. ONE draft forward over [that token] + draft2's tree (tree mask):
     (a) verifies draft2's proposals greedily: the spine walks the draft's argmax through them,
         so every match is a token the draft itself would have produced (origin draft2);
     (b) gives every node run its top-`width` children, candidates for the target's tree;
  until the spine reaches depth D. The target batch is then the `budget` best candidates by
  cumulative draft probability, exactly as for the best-first tree.
In a group of rows (drafting/batched_tree.py), step 3 is one draft forward for every row's spine step:
each row's grow yields its block and receives its rows of the forward; draft2 proposes between levels.
Nodes carry no q (draft2's proposals have none): under sampling the engine verifies every staged
tree by sample-walk, lossless for any tree built before the target's draws.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specstack.config import WindowSpec
from specstack.drafting.base import DraftContext
from specstack.drafting.batched_tree import Growth, TreeGroup
from specstack.drafting.candidates import NextTokens
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.drafting.ngram import STAGED_WIDTHS
from specstack.models.base import LoadedModel
from specstack.prefix_cache import PrefixCache
from specstack.tree import DraftTree


class ProposalSource(Protocol):
    def reset(self, prompt_ids: Sequence[int]) -> None: ...

    def proposal_tree(self, context: Sequence[int], widths: Sequence[int]) -> DraftTree: ...


class StagedDrafter(ModelDrafter):
    carries_q = False  # draft2's nodes have no q: every staged tree is verified by sample-walk

    def __init__(self, draft: LoadedModel, draft2: ProposalSource, params: TreeParams,
                 widths: Sequence[int] = STAGED_WIDTHS, window: WindowSpec | None = None,
                 prefix: PrefixCache | None = None, group: TreeGroup | None = None) -> None:
        """group: the group it drafts with (batched_tree.py; its rows' spines share each draft forward);
        draft2 is its own (its context is its row's)."""
        self.widths = tuple(widths)  # before ModelDrafter joins its group by level_shape
        super().__init__(draft, params, window, prefix, group)
        self.draft2 = draft2

    def level_shape(self) -> tuple[int, int]:
        # each spine step (a level, at least one deeper) runs its token and, at most, all of draft2's tree
        return self.params.depth, 1 + sum(self.widths)

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        super().reset(prompt_ids, target_hidden)
        self.draft2.reset(prompt_ids)

    def grow(self, root: NextTokens, ctx: DraftContext) -> Growth:
        """The spine's steps, each one level: draft2's proposal under the next spine token (between
        levels, as the paper's round does), yielded with that token for one draft forward."""
        cands = self.candidates
        depth_limit = self.max_run_depth()  # nodes up to this depth may be run
        self.expand(-1, root, 0, ctx)
        # next-token distribution of every expanded node: (the forward's rows, its row)
        dist: dict[int, tuple[NextTokens, int]] = {-1: (root, 0)}
        spine_end, spine_tokens = -1, list[int]()
        while cands.depth(spine_end) < depth_limit:
            # 1. the draft's own next token at the spine end (its argmax is always a top child)
            token = self._best(dist, spine_end)
            nxt = cands.child(spine_end, token)
            if self.sized and (nxt is None or nxt not in self.selected()):
                break  # running it would only grow children that are not worth verifying
            if nxt is None:
                nxt = cands.add(token, spine_end, 0.0)
            # 2. draft2's proposal tree under it, mapped onto candidates (existing ones are reused)
            proposal = self.draft2.proposal_tree(list(ctx.tokens) + spine_tokens + [token], self.widths)
            block = [] if cands[nxt].expanded else [nxt]
            mapped: dict[int, int] = {}
            for i, (tok, par) in enumerate(zip(proposal.tokens, proposal.parent, strict=True)):
                parent = nxt if par < 0 else mapped.get(par)
                if parent is None or cands.depth(parent) >= depth_limit:
                    continue
                c = cands.child(parent, tok)
                if c is None:
                    c = cands.add(tok, parent, 0.0, origin=proposal.origin[i])
                else:
                    cands[c].origin = proposal.origin[i]  # draft2 proposed it too
                mapped[i] = c
                if not cands[c].expanded:
                    block.append(c)
            if not block:
                break
            # 3. one draft forward: scores of the new nodes, their children, draft2's verification
            block.sort()  # candidates are created parents-first: index order is topological
            rows = yield block
            for row, c in enumerate(block):
                dist[c] = (rows, row)
            for c in block:  # parents first, so each score builds on a final one
                cands[c].score = self._score(c, dist)
            for row, c in enumerate(block):
                self.expand(c, rows, row, ctx)
            proposed = set(mapped.values())
            node = nxt
            spine_tokens.append(token)
            while cands.depth(node) < depth_limit:
                want = self._best(dist, node)
                ch = cands.child(node, want)
                if ch is None or ch not in proposed:
                    break  # draft2 did not propose the draft's next token: the draft continues
                node = ch
                spine_tokens.append(want)
            spine_end = node

    @staticmethod
    def _best(dist: dict[int, tuple[NextTokens, int]], node: int) -> int:
        rows, row = dist[node]
        return rows.best(row)

    def _score(self, c: int, dist: dict[int, tuple[NextTokens, int]]) -> float:
        """Candidate c's path probability: its parent's times the draft's probability of c there."""
        cand = self.candidates[c]
        rows, row = dist[cand.parent]
        return self.candidates.score(cand.parent) * rows.prob(row, cand.token)
