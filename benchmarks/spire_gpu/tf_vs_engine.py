"""The engine's chain τ beside the teacher-forced count on the same text (docs/bench-history, "Drafts
trained on a GPU"): the first N HumanEval prompts, 128 greedy tokens each, bf16 target.

    PYTHONPATH=. python benchmarks/spire_gpu/tf_vs_engine.py DRAFT.safetensors N K DRAFT_DTYPE

Prints the engine's τ and acceptance per depth, then α, τ over every position and the walk τ of the
teacher-forced count (distill.ChainCounts) on the target's own greedy continuations, for chains that
start in the generated part.
"""
from __future__ import annotations

import sys

import torch

from specstack.bench.datasets import humaneval_prompts
from specstack.config import GenerationConfig
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, parse_method
from specstack.models.draft_file import load_draft_file
from specstack.models.loading import load_model
from specstack.training.distill import ChainCounts
from specstack.training.teacher import OnlineTeacher, TeacherSpec, hidden_for


def main(draft_path: str, n: int, k: int, draft_dtype: str) -> None:
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", dtype="bf16")
    gen = GenerationConfig(max_new_tokens=128, stop_on_eos=False)
    sources = DraftSources(draft=draft_path, draft_dtype=draft_dtype)
    texts, emitted, forwards, accepted = [], 0, 0, []
    for prompt in humaneval_prompts(n):  # the raw prompt, as `specstack bench` encodes it
        ids = target.tokenizer.encode(prompt)
        texts.append((list(ids) + list(generate(target, ids, gen).tokens), len(ids)))
        r = generate(target, ids, gen, drafter=build_drafter(parse_method(f"chain:k={k}"), target, sources, "cpu"))
        emitted, forwards = emitted + r.stats.new_tokens, forwards + r.stats.target_forwards
        accepted += [s.accepted for s in r.stats.steps]
    alpha = [sum(a >= j for a in accepted) / max(1, sum(a >= j - 1 for a in accepted)) for j in range(1, k + 1)]
    print(f"engine: tau {emitted / forwards:.3f}, alpha by depth {[round(a, 3) for a in alpha]}")
    draft = load_draft_file(draft_path, target, dtype=torch.float32).model
    counts = ChainCounts(k)
    for seq, n_prompt in texts:
        t = torch.tensor([seq], dtype=torch.int32)
        batch = next(OnlineTeacher(target.model, t[:0], t, TeacherSpec(layers=draft.spire.target_layers)).heldout_batches())
        outs = draft.train_forward(batch["tokens"].long(), hidden_for(batch, draft.spire.target_layers), k)
        guesses = [draft.vocab_ids[o[0].argmax(-1)][n_prompt - 1:] for o in outs]
        counts.add(batch["tokens"][0, n_prompt - 1:].long(), batch["topk_ids"][0, n_prompt - 1:, 0].long(), guesses)
    acc = counts.result()
    print(f"teacher-forced on the greedy text: alpha {[round(a, 3) for a in acc.alpha]}, tau {acc.tau:.3f}, "
          f"walk tau {acc.walk_tau:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
