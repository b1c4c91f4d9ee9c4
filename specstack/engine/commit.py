"""Step 5 of the engine (engine/batched.py): what a row keeps of the step's forward, one job a function.

A prompt chunk's row commits the chunk (`chunk`); a verified row commits its chain and accepted path
to the cache (`path`), tells its drafter the verdict on the nodes that drafter proposed
(`tell_drafter`), emits the tokens to its stream (`emit`), records the round in its statistics
(`record_round`) and moves on (`settle`). Each function changes one row's state only; the engine does
what touches the batch (the prefix cache, removing finished rows, the length rule, the step's record).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from specstack.cache import KVCache
from specstack.engine.plan import RowState
from specstack.engine.rows import Block, Row
from specstack.engine.stats import BatchStep, StepStats, emitted_origins
from specstack.engine.verify_rows import Verdict
from specstack.processing import TokenLogprob
from specstack.verify import VerifyResult


@dataclass(frozen=True)
class Activations:
    """The target's activations of a step's forward that drafters read: {layer: [N, d]}, the token at
    position j of row i's block at flat index starts[i] + j."""

    hidden: Mapping[int, torch.Tensor]
    starts: Sequence[int]

    def of(self, i: int, layers: Sequence[int], first: int, n: int) -> torch.Tensor:
        """[1, n, L, d]: row i's block's tokens first .. first + n - 1, at each of `layers`."""
        at = self.starts[i] + first
        return torch.stack([self.hidden[layer][at : at + n] for layer in layers], 1).unsqueeze(0)

    def at(self, i: int, layers: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """[1, len(positions), L, d]: row i's block's tokens at `positions`, at each of `layers`."""
        index = torch.tensor([self.starts[i] + j for j in positions], dtype=torch.long,
                             device=self.hidden[layers[0]].device)
        return torch.stack([self.hidden[layer].index_select(0, index) for layer in layers], 1).unsqueeze(0)


class Settled(Enum):
    """What a row's commit leaves the engine to do with it."""

    GOING = "going"  # nothing: it decodes on
    READ = "read"  # its prompt is read now: publish it to the prefix cache
    FINISHED = "finished"  # it is done: publish, return its result, free its slot


def chunk(cache: KVCache, i: int, row: Row, block: Block, seen: Activations) -> Settled:
    """A prompt chunk (row i, no verdict): all of it is context; the activations a drafter reads of it are
    kept for the drafter's start."""
    chain = len(block.chain)
    cache.commit_nodes(i, list(range(chain)))
    row.pending = row.pending[chain:]
    if row.layers and chain:
        row.hidden.append(seen.of(i, row.layers, 0, chain))
    if len(row.pending) == 1 and row.state is RowState.PREFILLING:  # its root is next
        row.move(RowState.DECODING)
        row.prefilled = time.perf_counter()
        return Settled.READ
    return Settled.GOING


def path(cache: KVCache, i: int, block: Block, result: VerifyResult) -> None:
    """Row i's chain and the accepted path of its tree become context."""
    chain = len(block.chain)
    cache.commit_nodes(i, list(range(chain)) + [chain + a for a in result.accepted])


def tell_drafter(i: int, row: Row, block: Block, result: VerifyResult, seen: Activations) -> None:
    """The verdict on the nodes the row's drafter proposed (the block is the root and the tree): accepted
    up to where a grammar's forced nodes start, so a drafter never commits a node it did not run; every
    emitted token follows. A drafter that reads the target's activations gets those of the root and the
    whole accepted path, forced nodes included (it runs none of them: it writes their memories)."""
    assert row.drafter is not None
    chain = len(block.chain) - 1  # the root's place in the block
    hidden = seen.at(i, row.layers, [chain, *(chain + 1 + a for a in result.accepted)]) if row.layers else None
    own = block.drafted
    mine = [a for a in result.accepted if a < len(own)]  # a path: the drafter's nodes come first
    row.drafter.observe(own, result if mine == result.accepted else VerifyResult(mine, result.tokens), hidden)


def emit(row: Row, block: Block, result: VerifyResult, logprobs: list[TokenLogprob] | None) -> int:
    """The verified tokens to the row's stream (which may stop early: returns how many it took), its logits
    rules and its drafter's context; the last one is the row's next root."""
    origins = emitted_origins(block.tree, result) if row.drafter is not None else None
    taken = row.stream.push(result.tokens, origins, logprobs)
    if row.processor is not None:
        row.processor.commit(result.tokens[:taken])
    row.ctx.tokens.extend(result.tokens)
    row.pending = [result.tokens[-1]]
    return taken


def record_round(row: Row, block: Block, result: VerifyResult, taken: int,
                 seconds: tuple[float, float, float]) -> StepStats | None:
    """The round in the row's statistics: a step record for a row with a drafter (every forward with a
    tree is a step; seconds: the step's draft, target and verify time, which it waited), else a target
    forward; but the round that read the prompt's end (its last chunk and root) is prefill for both.
    Returns the step record, if any."""
    step = None
    if row.drafter is not None and block.decodes:
        step = StepStats(draft_seconds=seconds[0], target_seconds=seconds[1], verify_seconds=seconds[2])
        step.record(block.tree, result, taken)
        row.stats.add_step(step)
    elif row.drafter is None and row.first_token is not None:
        row.stats.target_forwards += 1
    if row.first_token is None:
        row.first_token = time.perf_counter()
        row.prefilled = row.prefilled or row.first_token
    return step


def settle(row: Row, max_context: int) -> Settled:
    """After its round: finished (its stream stopped or its context is full), its prompt read (the round
    that read its last chunk), or going on."""
    if row.stream.done or len(row.ctx.tokens) >= max_context:
        row.move(RowState.FINISHED)
        return Settled.FINISHED
    if row.state is RowState.PREFILLING:
        row.move(RowState.DECODING)
        return Settled.READ
    return Settled.GOING


def step_record(blocks: Sequence[Block], verdicts: Mapping[int, Verdict], layout: str,
                draft_forwards: int) -> BatchStep:
    """The step as the engine's statistics keep it (draft_forwards: the draft-model forwards its drafters ran).
    Its rounds are its decoding rows' verifications: a prompt's last chunk gives its first token as prefill."""
    results = [result for i, (result, _) in verdicts.items() if blocks[i].decodes]
    return BatchStep(rows=len(blocks), tokens=sum(len(b) for b in blocks), layout=layout,
                     drafted=sum(len(b.tree) for b in blocks), accepted=sum(len(r.accepted) for r in results),
                     drafting=sum(1 for b in blocks if len(b.tree)), verified=len(results),
                     emitted=sum(len(r.tokens) for r in results), draft_forwards=draft_forwards)
