"""The drafter interface (HF candidate-generator style): propose a tree, observe the verdict.

The engine never looks at what kind of drafter it holds (DESIGN §2.5). A drafter keeps whatever
state it needs (its own KV cache, n-gram tables, the context seen so far) and is told after every
step which of its nodes were accepted, so it can commit them and catch up.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specstack.config import SamplingParams
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


class LogitsRule(Protocol):
    """A request's rules for the target's logits (penalties, a bias, a grammar's mask: processing.py),
    as a drafter applies them to its own logits so that its q is the processed draft's."""

    def __call__(self, logits: torch.Tensor, paths: Sequence[Sequence[int]],
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, V'] (row r scores what follows `paths[r]`, the tokens after the root; column j is
        token ids[j], or token j) -> processed logits (fp32, a new tensor)."""


@dataclass
class DraftContext:
    tokens: list[int]  # prompt + every emitted token; the tree hangs off tokens[-1] (the root)
    sampling: SamplingParams  # the target's warp: a drafter that reports q must warp with it
    generator: torch.Generator | None = None
    # the most nodes the engine will verify this step (the step's draft-length rule sets it before the
    # drafter proposes, so no draft work goes into nodes it would cut); None: the drafter's own size
    limit: int | None = None
    # the same rule's estimate, while a best-first tree grows, of how many of its nodes (their cumulative
    # draft probabilities, best first) it would keep (drafting/batch_length.py `size`); None: none
    size: Callable[[Sequence[float]], int] | None = None
    # the request's logits rules, or None. Verification applies them to the target's rows (so no draft
    # can change what is emitted); a model drafter applies them to its own rows too, so it proposes
    # what the processed target would: under a grammar, only tokens the grammar allows
    rule: LogitsRule | None = None
    # what the drafter has learned, since it last proposed, of earlier proposals the engine cut unverified
    # ((evidence, right?): a deterministic proposal is accepted exactly when it equals the target's
    # token): the step's length rule counts them as trials of their class (BatchLength.learn)
    lessons: list[tuple[Hashable, bool]] = field(default_factory=list)

    def take_lessons(self) -> list[tuple[Hashable, bool]]:
        lessons, self.lessons = self.lessons, []
        return lessons


class DraftGroup(Protocol):
    """Drafters that propose together: a batch's rows drafted by one draft model in one forward per
    draft step or tree level (drafting/batched_tree.py: chains and trees alike). Every drafter that runs a
    draft model proposes through a group (a lone one through a group of one), which counts its forwards."""

    def propose_rows(self, drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Each drafter's tree (drafters of this group, each with its row's context)."""

    def draft_forwards(self) -> int:
        """The draft model's forwards this group has run so far (an engine's step reports its own)."""


class Drafter(Protocol):
    # Target hidden layers (0 = embeddings, i = output of block i) this drafter reads for verified
    # tokens (SPIRe's target activations); () for most. The engine asks its forwards for them.
    target_layers: tuple[int, ...]
    # The group this drafter proposes with, or None (it proposes alone). A batched engine asks a group
    # for all its rows' trees at once; `propose` alone is the same for one row.
    @property
    def group(self) -> DraftGroup | None: ...

    def reset(self, prompt_ids: Sequence[int], target_hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence (e.g. prefill the draft model's cache with the prompt).
        target_hidden [1, len(prompt) - 1, L, d]: the target's hidden states of all but the last
        prompt token (None when target_layers is empty)."""

    def propose(self, ctx: DraftContext) -> DraftTree:
        """A tree of candidate continuations of ctx.tokens (may be empty)."""

    def observe(self, tree: DraftTree, result: VerifyResult, target_hidden: torch.Tensor | None = None) -> None:
        """The target accepted result.accepted (node ids of `tree`) and emitted result.tokens.
        target_hidden [1, len(result.tokens), L, d]: the target's hidden states of the root and of every
        emitted token but the last (the accepted path, with any tokens a grammar forced below it)."""
