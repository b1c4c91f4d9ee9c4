"""Step 4 of the engine (engine/batched.py): each row whose block reached its root, verified on its own
(verify.verify_tree with its sampling and generator, its logits rules applied along each node's path),
and the log-probabilities it asked for, of the raw logits of the rows that scored its tokens."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specstack.engine.rows import Block, Row
from specstack.processing import TokenLogprob, token_logprobs
from specstack.sampling import argmax_rows
from specstack.verify import VerifyResult, verify_tree, walk_greedy

Verdict = tuple[VerifyResult, list[TokenLogprob] | None]  # a row's verification and its tokens' log-probabilities


def verify_rows(rows: Sequence[Row], blocks: Sequence[Block], logits: torch.Tensor) -> dict[int, Verdict]:
    """Row index -> its verdict. logits: the forward's kept rows in block order, each block's `scored`
    prompt rows, then, for a block that reached its root, the root's and its tree's. The greedy rows
    without logits rules walk their trees along one argmax of all the forward's rows."""
    verdicts, at = {}, 0
    best: list[int] | None = None  # the argmax of every kept row, once a greedy row needs it
    for i, (row, block) in enumerate(zip(rows, blocks, strict=True)):
        gen = row.request.gen
        if block.scored:  # a prompt chunk's rows: log-probabilities of the tokens after each
            first = len(row.request.prompt_ids) - len(row.pending) + 1  # the token row 0 scored
            toks = row.request.prompt_ids[first : first + block.scored]
            row.prompt_logprobs += token_logprobs(logits[at : at + block.scored], toks, gen.logprobs or 0)
            at += block.scored
        if block.reaches_root:
            k = 1 + len(block.tree)  # root + tree
            raw = logits[at : at + k]
            if gen.sampling.greedy and row.processor is None:
                best = argmax_rows(logits) if best is None else best
                result = walk_greedy(block.tree, best[at : at + k])
            else:
                scores = raw if row.processor is None else row.processor.process(raw, block.tree)
                result = verify_tree(block.tree, scores, gen.sampling, row.generator)
            lps = None
            if gen.logprobs is not None:
                kept = torch.tensor([0, *(a + 1 for a in result.accepted)], device=raw.device)
                lps = token_logprobs(raw[kept], result.tokens, gen.logprobs)
            verdicts[i] = (result, lps)
            at += k
    return verdicts
