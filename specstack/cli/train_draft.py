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
from contextlib import suppress
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack.cli.common import add_checked, add_threads_arg, check_threads, parse_contexts
from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_dir, check_writable_file, new_paths, remove_paths
from specstack.models.registry import DEFAULT_MODEL
from specstack.validate import MAX_CONTEXT, MAX_COUNT, MAX_TREE, VERIFIED, bounded_int, fits_context, floats, ints

if TYPE_CHECKING:
    import torch

RECIPES = ("spire", "vanilla")
COUNT = ints(1, MAX_COUNT)  # steps, sequences, batch sizes, blocks


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
    add_checked(p, "--steps", COUNT, default=1000, help="optimizer steps (default: 1000)")
    add_checked(p, "--out", path_arg, required=True, metavar="DIR", help="output folder")
    add_checked(p, "--teacher", path_arg, default=None, metavar="DIR",
                   help="teacher cache folder (default: OUT/teacher); share it between runs")
    add_checked(p, "--sequences", path_arg, default=None, metavar="FILE",
                   help="prepared token sequences: read when FILE exists (then --data is not read), else built "
                        "from --data and written there")
    p.add_argument("--prepare-only", action="store_true", help="stop after writing --sequences")
    p.add_argument("--online-teacher", action=argparse.BooleanOptionalAction, default=None,
                   help="run the target on each batch instead of caching it to disk (default: on for cuda)")
    p.add_argument("--contexts", default="", metavar="C1,C2,...",
                   help="also report held-out acceptance by context: chains starting after (C/2, C] tokens")
    add_checked(p, "--train-sequences", COUNT, default=2048, metavar="N", help="training sequences (default: 2048)")
    add_checked(p, "--heldout-sequences", COUNT, default=32, metavar="N", help="held-out sequences (default: 32)")
    add_checked(p, "--seq-len", ints(1, MAX_CONTEXT), default=512,
                help="tokens per sequence, within the target's context (default: 512)")
    add_checked(p, "--layers", COUNT, default=2, help="draft blocks, at most the target's (default: 2)")
    add_checked(p, "--vocab", ints(0, MAX_COUNT), default=8192,
                help="draft vocabulary: most frequent tokens, at most the target's; 0 = all (default: 8192)")
    add_checked(p, "--window", ints(0, MAX_CONTEXT), default=None,
                help="sliding window (spire default 256; 0 = full attention)")
    for flag, what in (("pruned-init", "start from the target's last blocks"), ("feedback", "feedback memory"),
                       ("target-acts", "target activations as memories of verified tokens"),
                       ("feature-input", "EAGLE-style input: the previous token's top-level feature")):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (default: on for spire, off for vanilla)")
    p.add_argument("--loss", choices=("kl", "ce", "mixed"), default="mixed", help="default: mixed (omega 0.5)")
    add_checked(p, "--omega", floats(0.0, 1.0), default=0.5, help="mixed loss weight in [0, 1] (default: 0.5)")
    add_checked(p, "--lr", floats(0.0, 1.0, low_open=True), default=None,
                help="learning rate in (0, 1] (default: 3e-4 pruned, 1e-3 random init)")
    add_checked(p, "--batch-size", COUNT, default=4,
                help="sequences per micro-batch, at most --train-sequences (default: 4)")
    add_checked(p, "--accumulate", COUNT, default=1, help="micro-batches per step (default: 1)")
    add_checked(p, "--draft-steps", ints(1, MAX_TREE, VERIFIED), default=3,
                help="unrolled chain positions trained (default: 3)")
    add_checked(p, "--eval-every", COUNT, default=200, help="steps between held-out evaluations (default: 200)")
    add_threads_arg(p, "torch threads (default: torch's own choice)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the teacher and the training run (default: cuda when present, else cpu)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.set_defaults(func=cmd_train_draft)
    return p


def path_arg(flag: str, text: str) -> Path:
    """A path flag's text as a Path; an empty one is refused: Path('') is the current folder, which
    the user did not name."""
    if not text:
        raise SpecstackError(f"{flag}: the path is empty")
    return Path(text)


def _check(args: argparse.Namespace) -> None:
    """What the flags' own rules (checked as they were parsed) cannot see: flags together, files."""
    bounded_int("--batch-size", args.batch_size, 1, args.train_sequences, "a batch is drawn from --train-sequences")
    check_threads(args.threads)
    check_writable_dir(args.out, "--out")
    if args.teacher is not None and not args.teacher.is_dir():  # an existing cache may be read-only: only read
        check_writable_dir(args.teacher, "--teacher")
    if args.prepare_only and args.sequences is None:
        raise SpecstackError("--prepare-only needs --sequences FILE (where the sequences are written)")
    if args.sequences is not None and not args.sequences.is_file():  # to be written once prepared
        check_writable_file(args.sequences, "--sequences", parents=True)
    args.contexts = parse_contexts(args.contexts, args.seq_len)


def _check_target(args: argparse.Namespace, tcfg: ModelConfig, shard_size: int | None) -> None:
    """The sizes the target bounds, checked once it is loaded, before any text is read or the teacher
    runs. shard_size: a cached teacher's sequences per shard, within which its batches are drawn (a
    larger batch would never be drawn: training would wait for ever); None for an online teacher."""
    fits_context("--seq-len", args.seq_len, tcfg.max_seq_len)
    bounded_int("--layers", args.layers, 1, tcfg.n_layers, "the target's blocks")
    if shard_size is not None:
        bounded_int("--batch-size", args.batch_size, 1, shard_size,
                    "a cached teacher draws each batch within one shard; --online-teacher has no such limit")


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
    """train_draft; when it fails (an error, Ctrl-C) before it saved a checkpoint to --resume from, what
    it created goes: the log, the teacher cache, OUT if nothing else is in it (a prepared --sequences
    file stays: it is complete and reusable)."""
    created = new_paths([args.out / "train.log", args.teacher or args.out / "teacher"])
    out_created = not args.out.exists()
    try:
        return train_draft(args)
    except BaseException:
        if not (args.out / "checkpoint.pt").is_file():
            remove_paths(created)
            if out_created:
                with suppress(OSError):
                    args.out.rmdir()  # only if empty
        raise


def train_draft(args: argparse.Namespace) -> int:
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
    _check_target(args, tcfg, None if online else spec.shard_size)
    # 1. sequences
    tdir = args.teacher or args.out / "teacher"
    cached = (tdir / "train" / "meta.json").is_file() and (tdir / "heldout" / "meta.json").is_file() and \
        len(list((tdir / "train").glob("shard_*"))) * spec.shard_size >= args.train_sequences
    train_seqs = held_seqs = None
    if args.sequences is not None and args.sequences.is_file():
        train_seqs, held_seqs = data_mod.load_sequences(args.sequences, args.seq_len, args.train_sequences,
                                                        args.heldout_sequences)
        data_mod.check_token_ids(args.sequences, tcfg.vocab_size, train_seqs, held_seqs)
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
    atomic_write_text(args.out / "acceptance.json", json.dumps(
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
