"""`specstack draft-acceptance`: held-out greedy acceptance of drafts by context, teacher-forced.

    specstack draft-acceptance --target smollm2-135m --sequences seq2048.safetensors \\
        --contexts 256,1024,2048 runs/spire/draft.safetensors runs/vanilla/draft.safetensors magicdec

Every design is measured on the same held-out sequences of a `train-draft --sequences` file with the
same counting (distill.ChainCounts: α per chain position, τ of a k-chain over every position and τ of
rounds walked along the text as decoding does, overall and for chains whose first query sees
(C/2, C] tokens):
- a draft file from `specstack train-draft` (fed the target's activations, as in the engine);
- `magicdec`: the target drafting for itself through a sliding-window KV of sink 1 + C // 8 positions
  at context C (the published convention; one window per context, so there is no overall figure);
- `magicdec:W`: the same with a fixed window of W positions.
A thin adapter (DESIGN §1): the counting lives in distill.py, the teacher in teacher.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack.cli.common import parse_contexts
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from specstack.models.transformer import Transformer
    from specstack.training.distill import Acceptance
    from specstack.training.teacher import OnlineTeacher

DEFAULT_CONTEXTS = (256, 1024, 2048)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("draft-acceptance", help="held-out greedy acceptance of drafts, by context",
                              description="Teacher-forced held-out acceptance (alpha per chain position, tau of a "
                                          "k-chain) of draft files and MagicDec, overall and by context.")
    p.add_argument("designs", nargs="+", metavar="DRAFT",
                   help="a draft file from `specstack train-draft`, magicdec, or magicdec:W")
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument("--sequences", type=Path, required=True, metavar="FILE",
                   help="a `train-draft --sequences` file: its held-out sequences are measured")
    p.add_argument("--heldout-sequences", type=int, default=64, metavar="N", help="held-out sequences (default: 64)")
    p.add_argument("--k", type=int, default=4, help="chain length (default: 4)")
    p.add_argument("--contexts", default=None, metavar="C1,C2,...",
                   help="context buckets, each at most the sequences' length (default: those of 256,1024,2048 "
                        "that fit)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_draft_acceptance)
    return p


def _magicdec_window(design: str) -> int | None:
    """None for `magicdec` (window C // 8 per context), W for `magicdec:W`."""
    _, _, w = design.partition(":")
    if not w:
        return None
    if not w.isdigit() or int(w) < 1:
        raise SpecstackError(f"{design}: the window must be a positive integer")
    return int(w)


def cmd_draft_acceptance(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specstack.models.draft_file import is_draft_file, load_draft_file
    from specstack.models.loading import load_model
    from specstack.training.data import read_sequences
    from specstack.training.distill import acceptance
    from specstack.training.teacher import OnlineTeacher, TeacherSpec

    if args.k < 1 or args.heldout_sequences < 1:
        raise SpecstackError("--k and --heldout-sequences must be >= 1")
    (held,) = read_sequences(args.sequences, ("heldout",))
    held = held[:args.heldout_sequences].to(torch.int32)
    seq_len = held.shape[1]
    contexts = parse_contexts(args.contexts or ",".join(str(c) for c in DEFAULT_CONTEXTS if c <= seq_len), seq_len)
    for d in args.designs:
        if d.split(":")[0] == "magicdec":
            _magicdec_window(d)
        elif not is_draft_file(d):
            raise SpecstackError(f"{d}: neither a draft file from `specstack train-draft` nor magicdec[:W]")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecstackError("--device cuda requested but no CUDA device is available")

    target = load_model(args.target, dtype="bf16", device=device, tokenizer=False)
    drafts = {d: load_draft_file(d, target, "fp32").model for d in args.designs
              if d.split(":")[0] != "magicdec"}
    layers = sorted({i for m in drafts.values() for i in m.spire.target_layers})
    teacher = OnlineTeacher(target.model, held[:0], held, TeacherSpec(layers=tuple(layers)))
    results: dict[str, Acceptance] = {}
    for d in tqdm(args.designs, desc="draft-acceptance", unit="design", file=sys.stderr):
        if d in drafts:
            results[d] = acceptance(drafts[d], teacher.heldout_batches(), args.k, len(held), contexts)
        else:
            results[d] = _magicdec(target.model, teacher, args.k, contexts, _magicdec_window(d))
    def cell(a: Acceptance) -> str:
        walk = "" if a.walk_tau is None else f" ({a.walk_tau:.3f})"
        return (f"{a.tau:.3f}" if a.alpha else "–") + walk

    head = " | ".join(f"({c // 2}, {c}]" for c in contexts)
    print(f"τ of a {args.k}-chain over every position, (in brackets) walked as decoding does; by context:")
    print(f"| design | overall | {head} | α overall |")
    print("|---|---:|" + "---:|" * len(contexts) + "---|")
    for d, acc in results.items():
        per = " | ".join(cell(acc.by_context[c]) for c in contexts)
        print(f"| {d} | {cell(acc)} | {per} | {', '.join(f'{a:.3f}' for a in acc.alpha)} |")
    if args.json:
        args.json.write_text(json.dumps({d: a.to_json() for d, a in results.items()}, indent=1))
    return 0


def _magicdec(target: Transformer, teacher: OnlineTeacher, k: int, contexts: tuple[int, ...],
              fixed: int | None) -> Acceptance:
    """The target's greedy guesses through a sliding-window KV, teacher-forced: with the accepted chain
    equal to the text, the draft's step-j guess at a position is its windowed prediction there."""
    import torch

    from specstack.attention import build_batch
    from specstack.config import WindowSpec
    from specstack.training.distill import Acceptance, ChainCounts

    windows = {c: fixed or max(1, c // 8) for c in contexts}
    per_window = {w: ChainCounts(k, contexts, target.device) for w in ({fixed} if fixed else set(windows.values()))}
    with torch.inference_mode():
        for batch in teacher.heldout_batches():
            tokens = batch["tokens"].long()
            greedy = batch["topk_ids"][0, :, 0].long()
            for w, counts in per_window.items():
                cache = target.new_cache(1, tokens.shape[1] + 8, window=WindowSpec(1, w))
                guess = target.forward(tokens, build_batch(cache, tokens.shape[1]), cache).logits[0].argmax(-1)
                counts.add(tokens[0], greedy, [guess] * k)
    if fixed is not None:
        return per_window[fixed].result()
    by_context = {c: per_window[windows[c]].result().by_context[c] for c in contexts}
    return Acceptance([], by_context)
