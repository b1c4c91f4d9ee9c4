"""Step 2 of the engine (engine/batched.py): each row's block of the step's forward, its pending tokens
the plan lets it read then, once they reach its root (but with its prompt's last chunk), a tree: its
drafter's (drafters of one group propose together: one draft forward per draft step, or tree level, for
all their rows) or, where its grammar forces tokens, those (engine/forced.py); within the plan's nodes
for it and cut by the step's length rule."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specstack.drafting.base import Drafter, DraftGroup
from specstack.drafting.batch_length import BatchLength, StepShape
from specstack.engine.forced import forced_chain
from specstack.engine.plan import StepPlan
from specstack.engine.rows import Block, Row
from specstack.tree import DraftTree


def propose_blocks(rows: Sequence[Row], plan: StepPlan, length: BatchLength, d_model: int,
                   device: torch.device) -> tuple[list[Block], int]:
    """Every row's block, and the draft-model forwards proposing them took (counted by the groups: a
    drafter with no group runs none); a drafter's first tree (its row reached its root for the first
    time) comes after it was reset with the prompt and, for one that reads them, the prompt's
    activations (d_model wide on `device`, gathered chunk by chunk in row.hidden)."""
    takes = [plan.reads.get(row.handle, 0) for row in rows]
    rooted = sum(take == len(row.pending) and row.drafter is not None and row.handle in plan.drafts
                 for row, take in zip(rows, takes, strict=True))  # the rows that draft a tree
    limit = length.limit(StepShape(len(rows), sum(takes), max(1, rooted)))
    trial = length.trial()  # the rows that may draft (None: all): the first in batch order
    blocks: list[Block] = []
    drafting: dict[int, tuple[Drafter, int]] = {}  # row -> its drafter and the most nodes it may verify
    grammar: dict[int, DraftTree] = {}  # row -> the tokens its grammar forces, as its tree this step
    reading: set[int] = set()  # rows reading their prompt's last chunk: no tree, nothing for the length rule
    for i, (row, take) in enumerate(zip(rows, takes, strict=True)):
        blocks.append(Block(row.pending[:take], DraftTree(), reaches_root=take == len(row.pending)))
        drafter = row.drafter
        if take == len(row.pending) and drafter is not None:  # a tree off the root
            if not row.started:
                drafter.reset(row.request.prompt_ids, prompt_hidden(row, d_model, device))
                row.started, row.hidden = True, []
            if row.handle not in plan.drafts:  # its prompt's last chunk: its first tree comes with the next token
                row.ctx.limit = 0  # its drafter proposes nothing (a draft model runs no forward), then hears the token
                drafting[i] = drafter, 0
                reading.add(i)
                continue
            cap = plan.drafts[row.handle]
            row.ctx.limit = cap if limit is None else min(limit, cap)
            forced = row.processor.forced() if row.processor is not None else []
            if trial is not None and row.ctx.limit and not forced:  # a trial: the first rows draft, the rest wait
                row.ctx.limit = row.ctx.limit if trial else 0
                trial = max(0, trial - 1)
            row.ctx.size = length.size  # a best-first drafter sizes its tree by the rule as it grows
            drafting[i] = drafter, row.ctx.limit
            if forced and row.ctx.limit:  # the grammar drafts this step; the drafter only catches up
                grammar[i] = forced_chain(forced, row.ctx.limit)
                row.ctx.limit = 0
    groups: dict[int, tuple[DraftGroup, list[int]]] = {}
    for i, (drafter, _) in drafting.items():
        group = drafter.group
        if group is None:
            blocks[i].tree = drafter.propose(rows[i].ctx)
        else:
            groups.setdefault(id(group), (group, []))[1].append(i)
    forwards = 0
    for group, members in groups.values():
        before = group.draft_forwards()
        trees = group.propose_rows([drafting[i][0] for i in members], [rows[i].ctx for i in members])
        forwards += group.draft_forwards() - before
        for i, tree in zip(members, trees, strict=True):
            blocks[i].tree = tree
    for i, (_, cap) in drafting.items():  # no tree outgrows what the plan gave it (the context's room too)
        blocks[i].tree = blocks[i].tree.truncated(cap)
    for i, chain in grammar.items():
        blocks[i].tree, blocks[i].own = chain, 0
    ruled = [i for i in drafting if i not in reading]
    if ruled:  # the step's draft length: rows with a drafter keep a prefix of their tree
        length.learn([lesson for i in ruled for lesson in rows[i].ctx.take_lessons()])
        keep = length.choose([blocks[i].tree for i in ruled], len(blocks), sum(len(b.chain) for b in blocks))
        for i, k in zip(ruled, keep, strict=True):
            blocks[i].tree = blocks[i].tree.truncated(k)
    return blocks, forwards


def prompt_hidden(row: Row, d_model: int, device: torch.device) -> torch.Tensor | None:
    """[1, len(prompt) - 1, L, d]: the target's activations of the prompt but its root, for a drafter
    that reads them (None for one that does not)."""
    if not row.layers:
        return None
    if row.hidden:
        return torch.cat(row.hidden, 1)
    return torch.zeros(1, 0, len(row.layers), d_model, device=device)
