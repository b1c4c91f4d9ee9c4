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
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specstack.bench.datasets import check_prompt_set, iter_prompts, select_prompts
from specstack.cli.common import choice_list, int_list
from specstack.config import WEIGHT_FORMATS
from specstack.errors import SpecstackError
from specstack.models.drafts import choose_draft
from specstack.models.registry import DEFAULT_MODEL, resolve
from specstack.throughput.check import check, table
from specstack.throughput.model import (
    CONVENTIONS,
    DESIGNS,
    PRESETS,
    Cell,
    Conventions,
    Draft,
    Hardware,
    b_crit,
    check_tau,
    grid,
    l_crit,
    magicdec_draft,
    spire_draft,
    vanilla_draft,
)
from specstack.throughput.shapes import (
    FORMATS,
    NAMED,
    ModelShape,
    draft_shape,
    looks_like_description,
    model_shape,
)

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
    g.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads")
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
    c.add_argument("--repeats", type=int, default=7, help="timed forwards per point (median; default 7)")
    c.add_argument("--warmup", type=int, default=2, help="untimed forwards per point (default 2)")
    c.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads")
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
    k.add_argument("--context", type=int, default=None, metavar="L",
                   help="context length (default: the prompts' mean length plus half the new tokens)")
    k.set_defaults(func=run_check)


# ---------------------------------------------------------------------------------------------------
# τ
# ---------------------------------------------------------------------------------------------------
def parse_tau(text: str, designs: list[str], k: int) -> tuple[dict[str, float], list[str]]:
    """(given τ per design, designs to measure). `auto` alone measures every design it can."""
    from specstack.throughput.measure_tau import MEASURABLE

    given: dict[str, float] = {}
    auto: list[str] = []
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SpecstackError("--tau is empty: give a number, design=value pairs, or auto")

    def value(design: str, raw: str) -> None:
        if raw == "auto":
            if design not in MEASURABLE:
                raise SpecstackError(f"--tau {design}=auto: the engine cannot run a {design} draft yet; give its τ")
            auto.append(design)
            return
        try:
            tau = float(raw)
        except ValueError:
            raise SpecstackError(f"--tau: {raw!r} is not a number") from None
        check_tau(tau, k)
        given[design] = tau

    for item in items:
        name, eq, raw = item.partition("=")
        name = name.strip()
        if not eq:
            if name == "auto":
                auto += [d for d in designs if d in MEASURABLE]
            else:
                for d in designs:
                    value(d, name)
            continue
        if name not in DESIGNS:
            raise SpecstackError(f"--tau: unknown design {name!r}; choose from {', '.join(DESIGNS)}")
        value(name, raw.strip())
    auto = [d for d in dict.fromkeys(auto) if d not in given and d in designs]
    return given, auto


def measure_taus(args: argparse.Namespace, designs: list[str], conv: Conventions) -> dict[str, float]:
    import torch
    from tqdm import tqdm

    from specstack.engine.methods import DraftSources, load_draft
    from specstack.models.loading import load_model
    from specstack.prompts import encode_prompt
    from specstack.throughput.measure_tau import magicdec_drafters, measure_tau

    if args.k == 0:
        return dict.fromkeys(designs, 1.0)  # no drafts: every round is one target step
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=args.engine_dtype)
    if target.tokenizer is None:
        raise SpecstackError(f"--tau auto: {args.target} has no tokenizer to encode the prompts with")
    prompts = select_prompts(iter_prompts(args.prompts), lambda p: encode_prompt(target.tokenizer, p.text, chat=p.chat),
                             args.limit, target.config.max_seq_len, args.max_new_tokens,
                             skip_long=args.prompts == "sharegpt")
    ids = [p.ids for p in prompts]
    taus: dict[str, float] = {}
    for design in designs:
        bar = tqdm(total=len(ids), desc=f"tau {design}", unit="prompt", leave=False, file=sys.stderr)
        if design == "vanilla":
            from specstack.drafting.model import ModelDrafter, TreeParams

            sources = DraftSources(draft=args.draft_spec, draft_dtype=args.engine_dtype)
            chain = ModelDrafter(load_draft(target, sources, "cpu"), TreeParams.chain(args.k))
            m = measure_tau(design, target, lambda _ids, d=chain: d, ids, args.max_new_tokens, bar.update)
        else:
            m = measure_tau(design, target, magicdec_drafters(target, args.k, conv), ids, args.max_new_tokens,
                            bar.update)
        bar.close()
        print(f"tau {design}: {m.tau:.3f} ({m.new_tokens} tokens in {m.rounds} rounds over {m.prompts} "
              f"{args.prompts} prompts, {args.engine_dtype})", file=sys.stderr)
        taus[design] = m.tau
    return taus


# ---------------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------------
def _loadable(spec: str) -> bool:
    return spec not in NAMED and not looks_like_description(spec)


def default_draft(target_spec: str, target: ModelShape) -> str:
    """The engine's draft for a loadable target (models/drafts.py), the fallback for a named shape or a
    description."""
    return str(choose_draft(None, target.n_layers, target_spec if _loadable(target_spec) else None))


def build_drafts(args: argparse.Namespace, target: ModelShape, draft: ModelShape) -> list[Draft]:
    made = {"vanilla": lambda: vanilla_draft(draft),
            "spire": lambda: spire_draft(target.in_format(args.draft_dtype), args.spire_layers, args.sparse_window),
            "magicdec": lambda: magicdec_draft(target, args.sparse_window)}
    return [made[d]() for d in args.designs]


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def _rate(value: float, unit: str) -> str:
    return "∞ (fitted to 0: the other terms cover it)" if value > 1e20 else f"{value / 1e9:,.1f} {unit}"


def _rates(hw: Hardware) -> str:
    if hw.overlap == "max":
        return f"HOI = {hw.hoi:.3g} FLOP/byte"
    return (f"F = {_rate(hw.flops_per_s, 'GFLOP/s')}, BW = {_rate(hw.bytes_per_s, 'GB/s')}, "
            f"BW_kv = {_rate(hw.kv_rate, 'GB/s')}")


def report(args: argparse.Namespace, target: ModelShape, drafts: list[Draft], cells: list[Cell], hw: Hardware,
           conv: Conventions) -> str:
    kind = "roofline (max)" if hw.overlap == "max" else "additive (FLOP and byte times add)"
    per_pass = f", {hw.seconds_per_pass * 1e3:.2f} ms per pass" if hw.seconds_per_pass else ""
    per_pass += f", {hw.seconds_per_layer * 1e3:.3f} ms per layer" if hw.seconds_per_layer else ""
    note = f" ({hw.note})" if hw.note else ""
    window = "1 + L // 8" if args.sparse_window is None else args.sparse_window
    lines = [
        (f"target {target.name}: N = {_count(target.params)} matrix parameters, {target.n_layers} layers, "
         f"x = {target.kv_values_per_token:,} KV values/token, {target.fmt}"),
        f"hardware {hw.name}: {_rates(hw)}, {kind}{per_pass}{note}",
        (f"k = {args.k}; conventions {args.conventions}: {conv.verify_tokens(args.k)} tokens verified, "
         f"sparse KV {window} positions"),
    ]
    if hw.overlap == "max":
        lc = l_crit(target, hw, args.k, conv)
        crit = ("∞ (verification never stays memory-bound at every batch)" if math.isinf(lc)
                else f"{lc:,.0f} tokens: from this context on, verification stays memory-bound at any batch")
        b_crits = ", ".join(f"L = {n:,}: " + (f"{b:,.1f}" if (b := b_crit(target, hw, n, args.k, conv)) is not None
                                              else "none") for n in args.context)
        lines += [f"L_crit = {crit}", f"B_crit (verification compute-bound from this batch on): {b_crits}"]
    else:
        lines.append("B_crit, L_crit: none on an additive machine (no roof: every verified token adds time)")
    for d in drafts:
        mine = [c for c in cells if c.design == d.design]
        if not mine:
            continue
        kv = "sparse KV" if d.sparse else "full KV"
        title = (f"## {d.design}: {d.shape.name} (N = {_count(d.shape.params)}, {d.shape.n_layers} layers, {kv}, "
                 f"{d.shape.fmt}), τ = {mine[0].tau:.3f}")
        lines += ["", title, "",
                  "multiplier τ/Δt (Δt) by batch B (rows) and context L (columns)", "",
                  "| B \\ L | " + " | ".join(f"{n:,}" for n in args.context) + " |",
                  "|---:|" + "---:|" * len(args.context)]
        value = {(c.batch, c.context): c for c in mine}
        for b in args.batch:
            lines.append(f"| {b} | " + " | ".join(f"{value[b, n].multiplier:.2f} ({value[b, n].round.delta_t:.2f})"
                                                 for n in args.context) + " |")
    return "\n".join(lines)


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
        if path is not None and not path.parent.is_dir():
            raise SpecstackError(f"{flag}: folder {path.parent} does not exist")


def run(args: argparse.Namespace) -> int:
    from specstack.throughput.calibrate import load_hardware

    # 1. cheap checks: numbers, hardware, shapes (configs only), τ
    _check_args(args)
    hw = load_hardware(args.hardware)
    conv = CONVENTIONS[args.conventions]
    args.dtype = args.dtype or hw.fmt
    args.draft_dtype = args.draft_dtype or args.dtype
    target = model_shape(args.target, args.dtype)
    args.draft_spec = args.draft or default_draft(args.target, target)
    draft = draft_shape(args.draft_spec, target, args.draft_dtype)
    if args.spire_layers > target.n_layers:
        raise SpecstackError(f"--spire-layers {args.spire_layers}: the target has {target.n_layers} layers")
    taus, auto = parse_tau(args.tau, args.designs, args.k)
    if auto:
        if not _loadable(args.target):
            raise SpecstackError("--tau auto runs the engine: --target must be a model it can load")
        if "vanilla" in auto and not (args.draft_spec.startswith("self:") or _loadable(args.draft_spec)):
            raise SpecstackError("--tau auto: the vanilla --draft must be self:N or a model the engine can load")
        check_prompt_set(args.prompts)
        # 2. measure τ with the engine
        taus |= measure_taus(args, auto, conv)
    for d in args.designs:
        if d not in taus:
            hint = "the engine has no SPIRe drafter yet: " if d == "spire" else ""
            print(f"{d}: left out, no τ ({hint}give it as --tau ...,{d}=T)", file=sys.stderr)
    drafts = build_drafts(args, target, draft)
    cells = grid(target, drafts, taus, args.batch, args.context, args.k, hw, conv)
    if not cells:
        raise SpecstackError("no design has a τ: nothing to model")
    # 3. report
    print(report(args, target, drafts, cells, hw, conv))
    from specstack.throughput.plot import heatmap

    title = (f"{target.name} on {hw.name}, k = {args.k}, conventions {args.conventions}\n"
             "modelled throughput multiplier of speculative decoding")
    heatmap(cells, args.batch, args.context, title, args.plot)
    print(f"\nheat-map written to {args.plot}", file=sys.stderr)
    if args.json is not None:
        data = {"target": asdict(target), "hardware": hw.to_json(), "conventions": asdict(conv), "k": args.k,
                "drafts": [asdict(d) for d in drafts],
                "cells": [{"design": c.design, "batch": c.batch, "context": c.context, "tau": c.tau,
                           "multiplier": c.multiplier, "delta_t": c.round.delta_t, **asdict(c.round)} for c in cells]}
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


# ---------------------------------------------------------------------------------------------------
# throughput-calibrate, throughput-check
# ---------------------------------------------------------------------------------------------------
def run_calibrate(args: argparse.Namespace) -> int:
    from specstack.throughput.calibrate import calibrate, local_path, save

    for flag, v in (("--repeats", args.repeats), ("--threads", args.threads)):
        if v is not None and v < 1:
            raise SpecstackError(f"{flag} must be >= 1, got {v}")
    if args.warmup < 0:
        raise SpecstackError(f"--warmup must be >= 0, got {args.warmup}")
    resolve(args.model)
    out = args.out or local_path()
    cal = calibrate(args.model, args.dtype, args.draft, args.draft_dtype, args.contexts, args.tokens, args.repeats,
                    args.warmup, args.threads)
    hw = cal.hardware
    print(f"fitted on {cal.machine['cpu']}, {cal.machine['threads']} threads: seconds = "
          f"{hw.seconds_per_pass * 1e3:.2f} ms + {hw.seconds_per_layer * 1e3:.3f} ms x layers "
          f"+ FLOPs / F + weight bytes / BW + KV bytes / BW_kv; {_rates(hw)}")
    print("\n| model | layers | T | context | measured ms | model ms | error |\n|---|---:|---:|---:|---:|---:|---:|")
    for s in cal.samples:
        pred = cal.predicted(s)
        print(f"| {s.model} | {s.layers} | {s.tokens} | {s.context} | {s.seconds * 1e3:.2f} | {pred * 1e3:.2f} "
              f"| {pred / s.seconds - 1:+.1%} |")
    print(f"\nrelative error: mean {cal.mean_rel_error:.1%}, max {cal.max_rel_error:.1%}")
    save(cal, out)
    print(f"calibration written to {out} (use it with --hardware {'local' if args.out is None else out})",
          file=sys.stderr)
    return 0


def run_check(args: argparse.Namespace) -> int:
    from specstack.throughput.calibrate import load_hardware

    if args.context is not None and args.context < 1:
        raise SpecstackError(f"--context must be >= 1, got {args.context}")
    hw = load_hardware(args.hardware)
    rows, draft = check(args.run_dir, hw, CONVENTIONS[args.conventions], args.context)
    print(f"{args.run_dir}: draft {draft}, batch 1, context {rows[0].context:.0f}, hardware {hw.name}, "
          f"conventions {args.conventions}\n")
    print(table(rows))
    return 0
