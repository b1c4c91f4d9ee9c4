"""Speculative decoding for one sequence: propose -> score -> verify -> commit (DESIGN §1).

The target's cache holds every token except the last emitted one (the root). Each step:
  1. the drafter proposes a tree hanging off the root;
  2. one target forward scores [root] + tree (ancestor mask): row 0 is the distribution after the
     root, row i + 1 the distribution after node i;
  3. a pure verifier walks the tree (greedy / sample-walk / recursive rejection sampling, chosen
     by the data: whether sampling, and whether every node carries its draft q);
  4. the root and the accepted path are committed (compacted) in the target's cache, the drafter is
     told the verdict, and the emitted tokens (accepted + one target token) are streamed.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specstack import interrupt
from specstack.attention import tree_batch
from specstack.config import GenerationConfig, SamplingParams
from specstack.drafting.base import DraftContext, Drafter
from specstack.drafting.batch_length import AsProposed, BatchLength
from specstack.engine.session import GenerationResult, open_session
from specstack.engine.stats import StepStats
from specstack.models.base import LoadedModel
from specstack.sampling import warp
from specstack.tree import DraftTree
from specstack.validate import MAX_TREE
from specstack.verify import VerifyResult, verify_greedy, verify_rrs, verify_sample_walk


def verify(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | None) -> VerifyResult:
    if sampling.greedy:
        return verify_greedy(tree, logits)
    p = warp(logits, sampling)
    if len(tree) and all(q is not None for q in tree.q):
        return verify_rrs(tree, p, generator)
    return verify_sample_walk(tree, p, generator)


def stack_hidden(hidden: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor | None:
    """{layer: [1, T, d]} -> [1, T, L, d] in the drafter's order (None when it reads none)."""
    return torch.stack([hidden[i] for i in layers], 2) if layers else None


def speculative_generate(target: LoadedModel, drafter: Drafter, prompt_ids: Sequence[int],
                         gen: GenerationConfig, on_text: Callable[[str], None] | None = None,
                         max_tree: int = MAX_TREE, length: BatchLength | None = None) -> GenerationResult:
    """length: the draft-length rule of every step (drafting/batch_length.py; the batch's rules with one
    row). None: the tree as the drafter proposes it."""
    length = length if length is not None else AsProposed()
    model, cfg = target.model, target.config
    run = open_session(target, prompt_ids, gen, on_text, scratch=max_tree + 1)
    stream, stats, cache, rng = run.stream, run.stats, run.cache, run.generator
    ctx = DraftContext(list(prompt_ids), gen.sampling, rng)

    layers = tuple(drafter.target_layers)  # target activations the drafter reads (SPIRe)
    t0 = time.perf_counter()
    hidden = None
    if len(prompt_ids) > 1:  # everything but the root
        out = model.extend(torch.tensor([list(prompt_ids[:-1])], device=model.device), cache, layers,
                           logit_rows=slice(0, 0))  # the root's logits come with the first step
        hidden = stack_hidden(out.hidden, layers)
    elif layers:
        hidden = torch.zeros(1, 0, len(layers), cfg.d_model, device=model.device)
    drafter.reset(prompt_ids, hidden)
    stats.prefill_seconds = time.perf_counter() - t0
    t_start = time.perf_counter()
    while not stream.done:
        interrupt.check()  # Ctrl-C stops the run here, between steps
        step = StepStats()
        # 1. propose (the tree may not outgrow the room left in the context), sized by the length rule
        t = time.perf_counter()
        ctx.limit = length.limit()
        tree = drafter.propose(ctx)
        room = min(max_tree, cfg.max_seq_len - len(ctx.tokens) - 1)
        tree = tree.truncated(max(0, room))
        tree = tree.truncated(length.choose([tree], 1, 1)[0])
        step.draft_seconds = time.perf_counter() - t
        # 2. score root + tree in one target forward
        t = time.perf_counter()
        tokens = torch.tensor([[ctx.tokens[-1]] + tree.tokens], device=model.device)
        parents = [-1] + [p + 1 for p in tree.parent]
        out = model.forward(tokens, tree_batch(cache, parents), cache, layers)
        logits = out.logits[0]
        step.target_seconds = time.perf_counter() - t
        # 3. verify
        t = time.perf_counter()
        result = verify(tree, logits, gen.sampling, rng)
        step.verify_seconds = time.perf_counter() - t
        # 4. commit root + accepted path; tell the drafter; emit
        t = time.perf_counter()
        cache.commit_nodes(0, [0] + [a + 1 for a in result.accepted])
        drafter.observe(tree, result, stack_hidden(out.hidden, layers))
        length.observe([tree], [len(result.accepted)])
        taken = stream.push(result.tokens)
        ctx.tokens.extend(result.tokens)
        step.record(tree, result, taken)
        step.overhead_seconds = time.perf_counter() - t
        stats.add_step(step)
    stats.decode_seconds = time.perf_counter() - t_start
    return run.result()
