"""DraftTree: a speculative batch shaped as a tree, as plain data (EAGLE/Medusa style).

Node 0..n-1 in topological order (a parent precedes its children); parent -1 marks the children of
the root, the last accepted token. Positions are root position + depth, and the attention mask is
the ancestors-or-self mask, both derived from `parent` through attention.py (the one mask builder).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from specstack.attention import ancestor_mask, depths_from_parents

Origin = Literal["draft", "draft2", "context", "grammar"]


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    origin: list[Origin] = field(default_factory=list)
    # q[i]: the draft's warped distribution at node i's parent (what node i was drawn from), or None
    # for deterministic proposals (top-k without sampling, n-gram lists).
    q: list[torch.Tensor | None] = field(default_factory=list)
    # confidence[i]: the drafter's estimate that the target accepts the path to node i (its cumulative
    # draft probability), or None. Only the step's draft-length rule reads it, to size the step
    # (drafting/batch_length.py); a drafter sets it only where sizing a tree by it keeps verification
    # lossless (deterministic proposals, or a greedy target).
    confidence: list[float | None] = field(default_factory=list)
    # evidence[i]: what the drafter knows of node i that predicts its acceptance (an n-gram's origin, the
    # length of the match behind it, its depth), or None; the length rule learns a rate per class of it
    evidence: list[Hashable | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.parent) == n and len(self.origin) in (0, n) and len(self.q) in (0, n)
                and len(self.confidence) in (0, n) and len(self.evidence) in (0, n)):
            raise ValueError("DraftTree fields must have one entry per node")
        for i, p in enumerate(self.parent):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} must precede it")
        if not self.origin:
            self.origin = ["draft"] * n
        if not self.q:
            self.q = [None] * n
        if not self.confidence:
            self.confidence = [None] * n
        if not self.evidence:
            self.evidence = [None] * n

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, origin: Origin = "draft", q: torch.Tensor | None = None,
            confidence: float | None = None, evidence: Hashable | None = None) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} does not exist")
        self.tokens.append(int(token))
        self.parent.append(parent)
        self.origin.append(origin)
        self.q.append(q)
        self.confidence.append(confidence)
        self.evidence.append(evidence)
        return len(self.tokens) - 1

    @property
    def depth(self) -> list[int]:
        return depths_from_parents(self.parent)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root) in insertion order."""
        return [i for i, p in enumerate(self.parent) if p == node]

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent[node]
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node-id paths."""
        has_child = set(self.parent)
        return [self.path_to(i) for i in range(len(self)) if i not in has_child]

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return ancestor_mask(self.parent, device)

    def truncated(self, n: int) -> "DraftTree":
        """The first n nodes: still a tree, since parents precede their children."""
        if n >= len(self):
            return self
        return DraftTree(self.tokens[:n], self.parent[:n], self.origin[:n], self.q[:n], self.confidence[:n],
                         self.evidence[:n])

    @staticmethod
    def chain(tokens: Sequence[int], origin: Origin = "draft") -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), [origin] * len(tokens))
