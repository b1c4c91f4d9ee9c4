"""`specstack train-draft`: distil a draft for a target (SPIRe recipe or a vanilla baseline).

    specstack train-draft --target smollm2-135m --recipe spire --data code:0.6,sharegpt:0.4 \\
        --steps 1500 --out runs/spire

1. text -> token sequences (train / held-out split by document; data.py), or read from a prepared
   --sequences file (written there when it does not exist yet; --prepare-only stops after it);
2. the teacher (the target in bf16): on CPU it runs once, top-k log-probs and hidden states to
   OUT/teacher (or a shared --teacher folder, so ablations reuse it); with --online-teacher (the
   default on CUDA) it runs on each batch instead (teacher.py says why);
3. the draft's vocabulary: the --vocab most frequent training tokens (plus EOS);
4. training (distill.py), checkpoints in OUT (--resume continues);
5. OUT/draft.safetensors (the draft's own weights, config and the command in its metadata),
   OUT/acceptance.json (held-out greedy acceptance per chain position and tau).
A thin adapter (DESIGN §1): the parts live in specstack/training/.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack.cli.common import parse_contexts
from specstack.config import WindowSpec
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

RECIPES = ("spire", "vanilla")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-draft", help="distil a draft model for a target (SPIRe or vanilla)",
                              description="Distil a draft for a target: teacher top-k cached once, then "
                                          "MixedLoss/KL/CE training with held-out acceptance.")
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument("--recipe", choices=RECIPES, default="spire",
                   help="spire: pruned from the target's last blocks, sliding window, feedback memory, target "
                        "activations; vanilla: the same shape from random weights, none of those")
    p.add_argument("--data", default="code:0.6,sharegpt:0.4",
                   help="sources and weights: code[=DIR]:W,sharegpt[=FILE]:W (default: code:0.6,sharegpt:0.4)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--teacher", type=Path, default=None, metavar="DIR",
                   help="teacher cache folder (default: OUT/teacher); share it between runs")
    p.add_argument("--sequences", type=Path, default=None, metavar="FILE",
                   help="prepared token sequences: read when FILE exists (then --data is not read), else built "
                        "from --data and written there")
    p.add_argument("--prepare-only", action="store_true", help="stop after writing --sequences")
    p.add_argument("--online-teacher", action=argparse.BooleanOptionalAction, default=None,
                   help="run the target on each batch instead of caching it to disk (default: on for cuda)")
    p.add_argument("--contexts", default="", metavar="C1,C2,...",
                   help="also report held-out acceptance by context: chains starting after (C/2, C] tokens")
    p.add_argument("--train-sequences", type=int, default=2048, metavar="N", help="training sequences (default: 2048)")
    p.add_argument("--heldout-sequences", type=int, default=32, metavar="N", help="held-out sequences (default: 32)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--layers", type=int, default=2, help="draft blocks (default: 2)")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: most frequent tokens, 0 = all (default: 8192)")
    p.add_argument("--window", type=int, default=None, help="sliding window (spire default 256; 0 = full attention)")
    for flag, what in (("pruned-init", "start from the target's last blocks"), ("feedback", "feedback memory"),
                       ("target-acts", "target activations as memories of verified tokens"),
                       ("feature-input", "EAGLE-style input: the previous token's top-level feature")):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (default: on for spire, off for vanilla)")
    p.add_argument("--loss", choices=("kl", "ce", "mixed"), default="mixed", help="default: mixed (omega 0.5)")
    p.add_argument("--omega", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-4 (pruned), 1e-3 (random init)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default: 4)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (default: 1)")
    p.add_argument("--draft-steps", type=int, default=3, help="unrolled chain positions trained (default: 3)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the teacher and the training run (default: cuda when present, else cpu)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.set_defaults(func=cmd_train_draft)
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "train_sequences", "heldout_sequences", "seq_len", "layers", "batch_size",
                 "accumulate", "draft_steps", "eval_every"):
        if getattr(args, name) < 1:
            raise SpecstackError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab < 0 or (args.window is not None and args.window < 0):
        raise SpecstackError("--vocab and --window must be >= 0")
    if not 0 <= args.omega <= 1:
        raise SpecstackError(f"--omega must be in [0, 1], got {args.omega}")
    if args.out.exists() and not args.out.is_dir():
        raise SpecstackError(f"--out {args.out} is a file")
    if args.prepare_only and args.sequences is None:
        raise SpecstackError("--prepare-only needs --sequences FILE (where the sequences are written)")
    if args.sequences is not None and args.sequences.is_dir():
        raise SpecstackError(f"--sequences {args.sequences} is a folder")
    args.contexts = parse_contexts(args.contexts, args.seq_len)


def token_counts(sequences: torch.Tensor | None, data: Any, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the training sequences (or, without them, in the teacher cache)."""
    import torch
    from safetensors import safe_open

    if sequences is not None:
        return torch.bincount(sequences.long().flatten(), minlength=vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in data.train_paths:
        with safe_open(str(p), "pt") as f:
            counts += torch.bincount(f.get_tensor("tokens").long().flatten(), minlength=vocab_size)
    return counts


def top_tokens(counts: torch.Tensor, n: int, always: tuple[int, ...]) -> torch.Tensor:
    """The draft vocabulary: the n most frequent tokens, and `always` (EOS) whatever their count."""
    counts = counts.clone()
    counts[list(always)] = counts.max() + 1
    return counts.topk(min(n, len(counts))).indices.sort().values


def _command(args: argparse.Namespace) -> str:
    """The run as one explicit command line, every option spelled out (what the draft file records)."""
    parts = ["specstack", "train-draft"]
    for key, value in vars(args).items():
        if key in ("func", "command", "resume", "prepare_only") or value is None or key.startswith("_"):
            continue
        if key == "contexts":
            value = ",".join(map(str, value))
            if not value:
                continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def cmd_train_draft(args: argparse.Namespace) -> int:
    import torch

    from specstack.models.draft_file import save_draft
    from specstack.models.loading import load_model
    from specstack.training import data as data_mod
    from specstack.training.acceptance import choose_device
    from specstack.training.distill import TrainParams, train
    from specstack.training.prune import build_draft, last_blocks
    from specstack.training.teacher import (
        CachedTeacher,
        OnlineTeacher,
        TeacherData,
        TeacherSpec,
        build_cache,
        shard_paths,
    )

    _check(args)
    sources = data_mod.parse_data_spec(args.data)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = choose_device(args.device)
    if args.online_teacher is None:
        args.online_teacher = args.device == "cuda"
    spire = args.recipe == "spire"
    pruned = spire if args.pruned_init is None else args.pruned_init
    target_acts = spire if args.target_acts is None else args.target_acts
    feedback = (spire if args.feedback is None else args.feedback) and target_acts
    feature_input = (spire if args.feature_input is None else args.feature_input) and target_acts
    window = args.window if args.window is not None else (256 if spire else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "train.log"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(msg + "\n")

    command = _command(args)
    log(f"# {time.strftime('%Y-%m-%d %H:%M')} {command}")
    target = load_model(args.target, dtype="bf16", device=args.device)
    tcfg = target.config
    keep = last_blocks(tcfg.n_layers, args.layers)
    spec = TeacherSpec(layers=tuple(k + 1 for k in keep))
    online = args.online_teacher
    # 1. sequences
    tdir = args.teacher or args.out / "teacher"
    cached = (tdir / "train" / "meta.json").is_file() and (tdir / "heldout" / "meta.json").is_file() and \
        len(list((tdir / "train").glob("shard_*"))) * spec.shard_size >= args.train_sequences
    train_seqs = held_seqs = None
    if args.sequences is not None and args.sequences.is_file():
        train_seqs, held_seqs = data_mod.load_sequences(args.sequences, args.seq_len, args.train_sequences,
                                                        args.heldout_sequences)
        log(f"{len(train_seqs)} training and {len(held_seqs)} held-out sequences of {args.seq_len} tokens "
            f"from {args.sequences}")
    elif online or not cached or args.sequences is not None:
        if target.tokenizer is None:
            raise SpecstackError(f"{args.target} has no tokenizer: cannot prepare training text")
        eos = (target.eos_token_ids or (0,))[0]
        log(f"reading text: {args.data}")
        train_seqs, held_seqs = data_mod.build_sequences(sources, target.tokenizer, eos, args.seq_len,
                                                         args.train_sequences, args.heldout_sequences)
        log(f"{len(train_seqs)} training and {len(held_seqs)} held-out sequences of {args.seq_len} tokens")
        if args.sequences is not None:
            data_mod.save_sequences(args.sequences, train_seqs, held_seqs, {"data": args.data})
            log(f"wrote {args.sequences}")
    if args.prepare_only:
        return 0
    # 2. the teacher (with the hidden states of the blocks a pruned draft starts from)
    if online:
        data: TeacherData = OnlineTeacher(target.model, train_seqs, held_seqs, spec)
    else:
        if not cached:
            build_cache(target.model, held_seqs, tdir / "heldout", spec, "held-out")
            build_cache(target.model, train_seqs, tdir / "train", spec, "train")
        data = CachedTeacher(shard_paths(tdir / "train"), shard_paths(tdir / "heldout"), args.device)
    # 3. the draft
    vocab_ids = None
    if args.vocab:
        counts = token_counts(train_seqs, data, tcfg.vocab_size)
        vocab_ids = top_tokens(counts, args.vocab, target.eos_token_ids)
    draft = build_draft(target.model, n_layers=args.layers, keep=keep if pruned else None,
                        window=WindowSpec(1, window) if window else None, feedback=feedback,
                        target_acts=target_acts, vocab_ids=vocab_ids, feature_input=feature_input).to(args.device)
    del target  # an online teacher keeps the target's weights
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {draft.spire.init}, window {draft.spire.window}, feedback {draft.spire.feedback}, "
        f"feature input {draft.spire.feature_input}, "
        f"target layers {draft.spire.target_layers}, vocab {len(draft.vocab_ids)}, {n_params / 1e6:.2f}M own parameters")
    # 4. training
    params = TrainParams(steps=args.steps, batch_size=args.batch_size, accumulate=args.accumulate,
                         lr=args.lr or (3e-4 if pruned else 1e-3), loss=args.loss, omega=args.omega,
                         draft_steps=args.draft_steps if target_acts else 1, eval_every=args.eval_every,
                         eval_sequences=args.heldout_sequences, contexts=args.contexts)
    if not target_acts:  # a plain decoder's chain positions all come from one pass: evaluate k = 4 anyway
        params = replace(params, draft_steps=1)
    began = time.perf_counter()
    acc = train(draft, data, params, args.out, resume=args.resume, log=log)
    seconds = time.perf_counter() - began
    # 5. outputs
    save_draft(draft, args.out / "draft.safetensors", {"target": args.target, "command": command,
                                                        "data": args.data, "steps": str(args.steps)})
    (args.out / "acceptance.json").write_text(json.dumps(
        acc.to_json() | {"train": asdict(params), "device": args.device, "online_teacher": online,
                         "seconds": round(seconds, 1), "tokens_per_s": round(_trained_tokens(params, args) / seconds)},
        indent=1))
    size = (args.out / "draft.safetensors").stat().st_size / 2**20
    log(f"wrote {args.out / 'draft.safetensors'} ({size:.1f} MiB); held-out tau {acc.tau:.3f} "
        f"(walked {acc.walk_tau or 0:.3f}) alpha {[round(a, 3) for a in acc.alpha]}; {seconds:.0f} s on {args.device}")
    for c, a in acc.by_context.items():
        log(f"  context ({c // 2}, {c}]: tau {a.tau:.3f} (walked {a.walk_tau or 0:.3f}) "
            f"alpha {[round(x, 3) for x in a.alpha]}")
    return 0


def _trained_tokens(params, args: argparse.Namespace) -> int:
    return params.steps * params.batch_size * params.accumulate * args.seq_len
