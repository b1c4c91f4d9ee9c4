"""A request's lifecycle and the plan of one engine step, as data (vLLM's scheduler: request states and
one token budget; tested without a model).

A request is WAITING in the queue until a cache row is free; it is PREFILLING while it reads its prompt
(chunk by chunk), DECODING once its next block starts at its root (the last prompt token or the last
emitted one), and it ends FINISHED (EOS, a stop string or its length: the stream's finish reason says
which) or CANCELLED. `transition` is the one place a state changes, and it refuses a change the
lifecycle does not have.

`plan_step` decides what one forward carries under ONE token budget (`step_tokens`), shared by prompt
chunks and speculative tokens:
  1. every decoding row's root (a running row never starves: its root is one token);
  2. prompt chunks, the oldest request first (handles count up in arrival order), then the requests
     taken from the queue into free rows (a request that finds no budget left reads from the next step);
     a `held` request (one whose prompt an older one is reading: it will copy it from the prefix cache)
     reads nothing yet;
  3. what is left goes to the trees of the decoding rows that draft, shared evenly (the oldest rows take
     the remainder), each at most `max_tree` nodes and what its context still holds. The step's
     draft-length rule (drafting/batch_length.py) then spends at most that.
So speculative tokens shrink while prompts wait, and a burst of new requests gets its first tokens as
fast as the budget reads prompts instead of waiting behind the running rows' trees.

A row reads its root with its prompt's last chunk, as autoregressive decoding does, so that chunk gives
its first token; its drafter starts from the whole prompt then and its first tree comes with that token.
A row whose drafter reads the target's activations of the prompt (SPIRe) `holds_root`: it reads all of
its prompt but the root first, so its drafter starts from those activations, and its first tree comes
with the root (DESIGN §6).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class RowState(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"


_NEXT: dict[RowState, frozenset[RowState]] = {
    RowState.WAITING: frozenset({RowState.PREFILLING, RowState.DECODING, RowState.CANCELLED}),
    # a prompt's last chunk may emit a token that ends the request at once (EOS, a length of 1)
    RowState.PREFILLING: frozenset({RowState.DECODING, RowState.FINISHED, RowState.CANCELLED}),
    RowState.DECODING: frozenset({RowState.FINISHED, RowState.CANCELLED}),
    RowState.FINISHED: frozenset(),
    RowState.CANCELLED: frozenset(),
}


class LifecycleError(RuntimeError):
    """A state change the lifecycle does not have (a bug in the engine, never a user's error)."""


def transition(state: RowState, to: RowState) -> RowState:
    """`to`, if a request in `state` may move there."""
    if to not in _NEXT[state]:
        raise LifecycleError(f"a {state.value} request cannot become {to.value}")
    return to


@dataclass(frozen=True)
class RowView:
    """What the planner knows of a request (running or waiting)."""

    handle: int  # arrival order: smaller is older
    state: RowState
    pending: int  # tokens not in the cache yet; the last is the root
    drafts: bool  # a drafter proposes its trees
    room: int = 0  # draft nodes its context still holds (decoding rows)
    # waits for an older request reading the same prompt, to copy it from the prefix cache once read
    held: bool = False
    # its drafter starts from the target's activations of the prompt but its root: it reads its root only
    # with its first tree
    holds_root: bool = False

    @property
    def prompt_left(self) -> int:
        """Tokens to read before the block that starts at the root (a row reads its root with its last
        chunk unless it `holds_root`)."""
        if self.pending <= 1:
            return 0
        return self.pending - 1 if self.holds_root else self.pending


@dataclass(frozen=True)
class StepPlan:
    admit: int = 0  # requests taken from the front of the queue this step
    reads: dict[int, int] = field(default_factory=dict)  # handle -> pending tokens its block reads
    drafts: dict[int, int] = field(default_factory=dict)  # handle -> most nodes its tree may have

    @property
    def tokens(self) -> int:
        """The most tokens the step's forward carries."""
        return sum(self.reads.values()) + sum(self.drafts.values())


def plan_step(running: Sequence[RowView], waiting: Sequence[RowView], free_rows: int, budget: int,
              max_tree: int) -> StepPlan:
    """The step's plan (module docstring). running: the rows in the cache; waiting: the queue in order;
    free_rows: rows the cache can still take; budget: the step's tokens (at least one per running row:
    roots are never cut)."""
    reads: dict[int, int] = {}
    left = budget
    decoding = [r for r in running if r.prompt_left == 0]
    for r in decoding:  # 1. roots
        reads[r.handle] = 1
        left -= 1
    # 2. prompts, oldest first; the queue's requests are younger than every running one
    for r in sorted((r for r in running if r.prompt_left), key=lambda r: r.handle):
        take = 0 if r.held else min(r.prompt_left, max(0, left))
        reads[r.handle] = take
        left -= take
    admit = 0
    for r in waiting:  # a free row is taken even when no budget is left: the request reads from the next step
        if admit >= free_rows:
            break
        admit += 1
        if r.held:
            continue
        take = min(r.prompt_left, max(0, left)) if r.prompt_left else 1  # a one-token prompt: its root
        reads[r.handle] = take
        left -= take
        if not r.prompt_left and r.drafts:
            decoding.append(r)
    # 3. trees, from what is left
    drafting = sorted((r for r in decoding if r.drafts), key=lambda r: r.handle)
    drafts: dict[int, int] = {}
    spare = max(0, left)
    for i, r in enumerate(drafting):
        share = spare // len(drafting) + (1 if i < spare % len(drafting) else 0)
        drafts[r.handle] = max(0, min(share, max_tree, r.room))
    return StepPlan(admit, reads, drafts)
