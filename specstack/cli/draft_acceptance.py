"""`specstack draft-acceptance`: held-out greedy acceptance of drafts by context, teacher-forced.

    specstack draft-acceptance --target smollm2-135m --sequences seq2048.safetensors \\
        --contexts 256,1024,2048 runs/spire/draft.safetensors runs/vanilla/draft.safetensors magicdec

Each DRAFT is a draft file from `specstack train-draft`, `magicdec` (the target behind a window of
sink 1 + C // 8 positions at context C), `magicdec:W`, or a model sharing the target's vocabulary
(`qwen2.5-coder-0.5b`; `qwen2.5-coder-0.5b@32768` with its head over the target's 32,768 most frequent
tokens), all measured on the same held-out sequences
with the same counting. A thin adapter (DESIGN §1): the measuring lives in training/acceptance.py
(whose docstring defines the figures), the counting in distill.py, the teacher in teacher.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specstack.cli.common import parse_contexts
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_file
from specstack.models.registry import DEFAULT_MODEL

DEFAULT_CONTEXTS = (256, 1024, 2048)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("draft-acceptance", help="held-out greedy acceptance of drafts, by context",
                              description="Teacher-forced held-out acceptance (alpha per chain position, tau of a "
                                          "k-chain) of draft files, MagicDec and draft models, overall and by "
                                          "context.")
    p.add_argument("designs", nargs="+", metavar="DRAFT",
                   help="a draft file from `specstack train-draft`, magicdec, magicdec:W, or a model sharing the "
                        "target's vocabulary (MODEL@K: its head over the target's K most frequent tokens)")
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


def cmd_draft_acceptance(args: argparse.Namespace) -> int:
    if args.k < 1 or args.heldout_sequences < 1:
        raise SpecstackError("--k and --heldout-sequences must be >= 1")
    if args.json is not None:
        check_writable_file(args.json, "--json")
    from specstack.training.acceptance import (  # the engine: torch
        check_designs,
        check_length,
        choose_device,
        heldout_tokens,
        is_magicdec,
        magicdec_window,
        measure_acceptance,
        table,
    )

    check_designs(args.designs)
    held = heldout_tokens(args.sequences, args.heldout_sequences)
    seq_len = held.shape[1]
    check_length(args.sequences, seq_len, args.k)
    contexts = parse_contexts(args.contexts or ",".join(str(c) for c in DEFAULT_CONTEXTS if c <= seq_len), seq_len)
    if not contexts and any(is_magicdec(d) and magicdec_window(d) is None for d in args.designs):
        # its window is set per context: without one there is nothing to measure
        why = (f"--contexts {args.contexts!r} names none" if args.contexts else
               f"the held-out sequences of {args.sequences} hold {seq_len} tokens, fewer than the smallest default "
               f"context {min(DEFAULT_CONTEXTS)}")
        raise SpecstackError(f"magicdec needs a context: {why}; pass --contexts C1,C2,... with each C in "
                             f"[2, {seq_len}], or use magicdec:W")
    device = choose_device(args.device)
    results = measure_acceptance(args.target, held, args.designs, args.k, contexts, device)
    print(table(results, args.k, contexts))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps({d: a.to_json() for d, a in results.items()}, indent=1))
    return 0
