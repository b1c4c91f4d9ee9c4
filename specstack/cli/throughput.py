"""`specstack throughput`: the modelled speculative speed-up over batch x context for a vanilla draft,
a SPIRe draft and MagicDec side by side (table + heat-map), `specstack throughput-calibrate`: this
machine's own hardware preset, and `specstack throughput-check DIR`: the model against a bench run.

    specstack throughput --target M --draft D --tau T --k K --batch 1,8,64 --context 512,4096,65536 \\
        [--hardware h100-fp8|a100-bf16|rtx4090-fp16|local|FILE] [--conventions engine|published] \\
        [--dtype F --draft-dtype F] [--spire-layers 2] [--sparse-window W] [--designs LIST] \\
        [--plot FILE.png] [--json FILE] [--prompts SET --limit N --max-new-tokens N]   (for --tau auto)
    specstack throughput-calibrate [--model M --dtype int4 --draft self:4] [--out FILE]
    specstack throughput-check BENCH_DIR [--hardware local]

Models (--target, --draft): a loadable model (only its config is read), a named shape (spire-67m,
llama-3-70b: the paper's conventions, body parameters only), a plain description
`layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=4096` (optional heads, params, vocab, window,
gated=0), or for the draft `self:N` (the target's first N blocks and its head). The SPIRe draft is
--spire-layers blocks of the target with a sparse KV; MagicDec is the target with a sparse KV
(sink 1 + L // 8 positions, or --sparse-window W).

--tau: one number for every design, `vanilla=2.647,spire=3.401,magicdec=3.891`, or `auto`, which
measures τ with the engine for the designs it can run (vanilla, magicdec) on --prompts; mix them as
`auto,spire=3.401`. The paper's check values: `--target spire-67m --k 4 --conventions published
--designs spire,magicdec --tau spire=3.401,magicdec=3.891 --batch 8,64 --context 512`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specstack.bench.datasets import check_prompt_set
from specstack.cli.common import add_checked, add_threads_arg, choice_list, int_list
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_file
from specstack.models.drafts import DraftKind, DraftSpec
from specstack.models.registry import DEFAULT_MODEL, resolve
from specstack.throughput.hardware import load_hardware
from specstack.throughput.model import CONVENTIONS, DESIGNS, PRESETS, Conventions, grid
from specstack.throughput.plot import heatmap
from specstack.throughput.report import GridSpec, build_drafts, grid_json, plot_title, report
from specstack.throughput.shapes import FORMATS, default_draft_spec, draft_shape, is_loadable, model_shape
from specstack.throughput.tau import missing_tau_note, parse_tau
from specstack.validate import MAX_CONTEXT, MAX_REPEATS, ints
from specstack.weight_formats import WEIGHT_FORMATS

HARDWARE_HELP = f"{', '.join(PRESETS)}, local (this machine's calibration) or a calibration file"


def add_parser(subparsers: Any) -> None:
    """Register `throughput`, `throughput-calibrate` and `throughput-check`."""
    p = subparsers.add_parser("throughput", help="model the speculative speed-up over batch x context",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_MODEL, metavar="MODEL", help=f"default {DEFAULT_MODEL}")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="the vanilla draft (default: the engine's default draft for the target, else self:layers/8)")
    p.add_argument("--tau", required=True, metavar="T", help="τ: a number, design=value list, or auto")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--batch", type=int_list, default=[1, 8, 64], metavar="LIST", help="default 1,8,64")
    p.add_argument("--context", type=int_list, default=[512, 4096, 65536], metavar="LIST",
                   help="default 512,4096,65536")
    p.add_argument("--hardware", default="h100-fp8", metavar="NAME", help=f"{HARDWARE_HELP} (default h100-fp8)")
    p.add_argument("--conventions", choices=tuple(CONVENTIONS), default="engine",
                   help="engine (default): k + 1 tokens verified, attention FLOPs counted; published: the "
                        "paper's (k tokens, no attention FLOPs)")
    p.add_argument("--dtype", choices=FORMATS, default=None, help="target weight format (default: the hardware's)")
    p.add_argument("--draft-dtype", choices=FORMATS, default=None, help="draft weight format (default: --dtype)")
    p.add_argument("--spire-layers", type=int, default=2, metavar="N", help="blocks of the SPIRe draft (default 2)")
    p.add_argument("--sparse-window", type=int, default=None, metavar="W",
                   help="KV positions of the sparse drafts (default: 1 + L // 8)")
    p.add_argument("--designs", type=choice_list(DESIGNS, "designs"), default=list(DESIGNS), metavar="LIST",
                   help="default vanilla,spire,magicdec")
    p.add_argument("--plot", type=Path, default=Path("throughput.png"), metavar="FILE",
                   help="heat-map PNG (default throughput.png)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every cell as JSON")
    g = p.add_argument_group("--tau auto")
    g.add_argument("--prompts", default="humaneval", metavar="SET", help="humaneval (default), sharegpt or JSONL")
    g.add_argument("--limit", type=int, default=8, metavar="N", help="prompts (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per prompt (default 64)")
    g.add_argument("--engine-dtype", choices=WEIGHT_FORMATS, default="int4",
                   help="weight format the engine runs target and drafts in (default int4)")
    add_threads_arg(g, "torch threads")
    p.set_defaults(func=run)

    c = subparsers.add_parser("throughput-calibrate", help="fit this machine's hardware preset from its forwards",
                              description="Time forwards of the target and a draft (bench-forward's protocol) "
                                          "and fit seconds = c0 + c_layer x layers + FLOPs/F + bytes/BW + KV bytes/BW_kv "
                                          "(specstack/throughput/calibrate.py).")
    c.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    c.add_argument("--dtype", choices=WEIGHT_FORMATS, default="int4", help="default int4")
    c.add_argument("--draft", default=None, metavar="MODEL", help="default: the engine's default draft")
    c.add_argument("--draft-dtype", choices=WEIGHT_FORMATS, default="int4", help="default int4")
    c.add_argument("--contexts", type=int_list, default=[128, 1024], metavar="LIST", help="default 128,1024")
    c.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16], metavar="LIST", help="default 1,2,4,8,16")
    add_checked(c, "--repeats", ints(1, MAX_REPEATS), default=7, help="timed forwards per point (median; default 7)")
    add_checked(c, "--warmup", ints(0, MAX_REPEATS), default=2, help="untimed forwards per point (default 2)")
    add_threads_arg(c, "torch threads")
    c.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="calibration file (default: the `local` preset in the specstack cache)")
    c.set_defaults(func=run_calibrate)

    k = subparsers.add_parser("throughput-check", help="the throughput model against a `specstack bench` run",
                              description="For every chain method of a finished greedy bench run: the model's "
                                          "multiplier at batch 1 beside the measured speed-up over ar "
                                          "(specstack/throughput/check.py).")
    k.add_argument("run_dir", type=Path, metavar="DIR", help="a `specstack bench --out` folder")
    k.add_argument("--hardware", default="local", metavar="NAME", help=f"{HARDWARE_HELP} (default local)")
    k.add_argument("--conventions", choices=tuple(CONVENTIONS), default="engine")
    add_checked(k, "--context", ints(1, MAX_CONTEXT), default=None, metavar="L",
                   help="context length (default: the prompts' mean length plus half the new tokens)")
    k.set_defaults(func=run_check)


# ---------------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------------
def measure_taus(args: argparse.Namespace, designs: list[str], conv: Conventions) -> dict[str, float]:
    """τ of `designs` measured with the engine on --prompts, each reported on stderr once measured."""
    from specstack.throughput.measure_tau import TauRun  # the engine: torch

    if args.k == 0:
        return dict.fromkeys(designs, 1.0)  # no drafts: every round is one target step
    run = TauRun.load(args.target, args.draft_spec, args.engine_dtype, args.prompts, args.limit, args.max_new_tokens,
                      args.k, conv, args.threads)
    taus: dict[str, float] = {}
    for design in designs:
        # closed even when the run fails, so that the error starts a line of its own
        with tqdm(total=len(run.prompts), desc=f"tau {design}", unit="prompt", leave=False, file=sys.stderr) as bar:
            m = run.measure(design, bar.update)
        print(f"tau {design}: {m.tau:.3f} ({m.new_tokens} tokens in {m.rounds} rounds over {m.prompts} "
              f"{args.prompts} prompts, {args.engine_dtype})", file=sys.stderr)
        taus[design] = m.tau
    return taus


def _check_args(args: argparse.Namespace) -> None:
    if args.k < 0:
        raise SpecstackError(f"--k must be >= 0, got {args.k}")
    if args.spire_layers < 1:
        raise SpecstackError(f"--spire-layers must be >= 1, got {args.spire_layers}")
    if args.sparse_window is not None and args.sparse_window < 1:
        raise SpecstackError(f"--sparse-window must be >= 1, got {args.sparse_window}")
    for flag, v in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if v is not None and v < 1:
            raise SpecstackError(f"{flag} must be >= 1, got {v}")
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        if path is not None:
            check_writable_file(path, flag)


def run(args: argparse.Namespace) -> int:
    # 1. cheap checks: numbers, hardware, shapes (configs only), τ
    _check_args(args)
    hw = load_hardware(args.hardware)
    spec = GridSpec(args.designs, args.k, args.batch, args.context, args.conventions, args.spire_layers,
                    args.sparse_window)
    args.dtype = args.dtype or hw.fmt
    args.draft_dtype = args.draft_dtype or args.dtype
    target = model_shape(args.target, args.dtype)
    args.draft_spec = args.draft or default_draft_spec(args.target, target)
    draft = draft_shape(args.draft_spec, target, args.draft_dtype)
    if args.spire_layers > target.n_layers:
        raise SpecstackError(f"--spire-layers {args.spire_layers}: the target has {target.n_layers} layers")
    taus, auto = parse_tau(args.tau, args.designs, args.k)
    if auto:
        if not is_loadable(args.target):
            raise SpecstackError("--tau auto runs the engine: --target must be a model it can load")
        runnable = DraftSpec.parse(args.draft_spec).kind == DraftKind.SELF or is_loadable(args.draft_spec)
        if "vanilla" in auto and not runnable:
            raise SpecstackError("--tau auto: the vanilla --draft must be self:N or a model the engine can load")
        check_prompt_set(args.prompts)
        # 2. measure τ with the engine
        taus |= measure_taus(args, auto, spec.conv)
    for d in args.designs:
        if d not in taus:
            print(missing_tau_note(d), file=sys.stderr)
    drafts = build_drafts(spec, target, draft, args.draft_dtype)
    cells = grid(target, drafts, taus, args.batch, args.context, args.k, hw, spec.conv)
    if not cells:
        raise SpecstackError("no design has a τ: nothing to model")
    # 3. report
    print(report(spec, target, drafts, cells, hw))
    heatmap(cells, args.batch, args.context, plot_title(spec, target, hw), args.plot)
    print(f"\nheat-map written to {args.plot}", file=sys.stderr)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(grid_json(spec, target, drafts, cells, hw), indent=1) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------------
# throughput-calibrate, throughput-check
# ---------------------------------------------------------------------------------------------------
def run_calibrate(args: argparse.Namespace) -> int:
    from specstack.throughput.calibrate import calibrate, save, summary  # the engine: torch
    from specstack.throughput.hardware import local_path

    resolve(args.model)
    out = args.out or local_path()
    check_writable_file(out, "--out", parents=True)
    cal = calibrate(args.model, args.dtype, args.draft, args.draft_dtype, args.contexts, args.tokens, args.repeats,
                    args.warmup, args.threads)
    print(summary(cal))
    save(cal, out)
    print(f"calibration written to {out} (use it with --hardware {'local' if args.out is None else out})",
          file=sys.stderr)
    return 0


def run_check(args: argparse.Namespace) -> int:
    hw = load_hardware(args.hardware)
    from specstack.throughput.check import check, table  # reads the run's methods with the engine: torch

    rows, draft = check(args.run_dir, hw, CONVENTIONS[args.conventions], args.context)
    print(f"{args.run_dir}: draft {draft}, batch 1, context {rows[0].context:.0f}, hardware {hw.name}, "
          f"conventions {args.conventions}\n")
    print(table(rows))
    return 0
