"""`specstack bench-forward`: specstack's forward and greedy generation against transformers (and
llama.cpp if present).

Part 1 (forward): for each weight format, prefill a context (default 256 tokens of HumanEval text),
then time forwards of T query tokens at that context, as a causal chain (`build_batch`) and as a
draft tree (`tree_batch`, a fixed binary tree of T nodes). Forwards never commit, so the cache's
committed length stays at the context and every repeat runs at the same context (cache.py: a
forward writes scratch slots only). The time includes building the attention metadata, as a decoding
step pays it (transformers builds its mask inside its forward too). Beside it, transformers' forward
of the same GGUF (bf16 and fp32) with a DynamicCache cropped back to the context after each forward.
All methods are measured interleaved (method order rotated per repeat) so machine drift cancels.
With a GGUF model, llama.cpp's `llama-bench` (benchmarks/build_llama_cpp.sh, LLAMA_CPP_EXTRA=llama-bench)
then times the same T at the same context and threads on the same file (its tg step for T = 1), and the
report puts ours / llama.cpp beside each T; a missing or failing llama-bench is one line in the report.
The physical limit is printed beside them: the machine's bandwidth (the best of 5 copies of 1 GiB) and,
per format, the bytes a one-token step reads, the step time at that bandwidth and the measured T = 1
forward against it.

Rows (--rows B1,B2,...; default 1): the batched curve. For every B > 1, B rows each hold the same
context and every format runs forwards of B rows x T tokens (chains, `build_batch`), interleaved as
above; trees and transformers stay at one row. With --ragged, the PAD/SPLIT crossover of the batched
engine (engine/batched.py): at each B >= 2, B - 1 decoding rows of one token beside one joining row's
prompt chunk of C tokens (--chunk), and the uniform step (every row one token), each timed with the
block padded to [B, C] (PAD) and packed to [1, C + B - 1] (SPLIT), logits of each row's last token.
With any B > 1 the report is also written beside the JSON file: forward.json -> forward.md (every
table; each B x T time also as a ratio to one row of one token) and, for two row counts or more, the
curve forward_rows.png (ms against B, one panel per format, one line per T).

Part 2 (generation): greedy, exactly --new-tokens tokens (EOS ignored) on the first --prompts
HumanEval prompts, specstack's `generate` in every format beside transformers' `generate` (bf16),
interleaved per prompt; tokens/s, mean per-prompt speed-up vs transformers bf16, and how many outputs
are token-identical to transformers'.

    specstack bench-forward --formats int4 --tokens 1,4 --repeats 2 --prompts 1 --new-tokens 8
    specstack bench-forward --formats int4,fp32 --rows 1,4,16,64 --tokens 1,2,4 --ragged --prompts 0 --skip-hf
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specstack.cli.common import (
    MODEL_HELP,
    add_checked,
    add_threads_arg,
    check_threads,
    choice_list,
    command_line,
    int_list,
    sizes,
    warn,
)
from specstack.errors import SpecstackError
from specstack.files import check_writable_file
from specstack.models.registry import DEFAULT_MODEL, resolve
from specstack.validate import (
    MAX_BATCH_SIZE,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_REPEATS,
    ints,
    new_tokens,
)
from specstack.weight_formats import WEIGHT_FORMATS

# bench_out/ is ignored by git: a re-run does not add megabytes to the history
DEFAULT_OUT = Path("bench_out/forward/forward.json")
DEFAULT_CHUNKS = [16, 64, 128]  # the engine's default prefill chunk is 128 tokens a step


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench-forward", help="time forwards and greedy generation vs transformers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--formats", type=choice_list(WEIGHT_FORMATS, "formats"), default=list(WEIGHT_FORMATS),
                   help="specstack weight formats")
    p.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="query tokens T per forward")
    add_checked(p, "--rows", sizes(MAX_BATCH_SIZE, "1,4,8,16,32,64", "each row holds a KV cache of its context"),
                default=[1], metavar="B1,B2,...",
                help="rows B per forward: 1 times one sequence (and trees, transformers), B > 1 the batched curve "
                     "(default 1)")
    p.add_argument("--ragged", action="store_true",
                   help="also time one row's prompt chunk beside B - 1 decoding rows, PAD vs SPLIT (needs a B >= 2)")
    add_checked(p, "--chunk", sizes(MAX_CONTEXT, "16,64,128", "longer than any model's context"), default=None,
                metavar="C1,C2,...", help="the prompt chunk's tokens C for --ragged (default 16,64,128)")
    add_checked(p, "--context", ints(1, MAX_CONTEXT), default=256,
                help="committed context before the timed forwards (with the widest T, within the model's context)")
    add_checked(p, "--repeats", ints(1, MAX_REPEATS), default=10,
                help="timed forwards per method and T (median reported)")
    add_checked(p, "--warmup", ints(0, MAX_REPEATS), default=3, help="untimed forwards per method and T")
    add_checked(p, "--prompts", ints(0, MAX_COUNT), default=20, help="HumanEval prompts for generation (0: skip part 2)")
    add_checked(p, "--new-tokens", new_tokens, default=128, help="tokens generated per prompt (EOS ignored)")
    add_threads_arg(p, "torch (and llama.cpp) threads", default=2)
    p.add_argument("--hf-dtypes", type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
                   default=["bf16", "fp32"], metavar="LIST",
                   help="transformers dtypes for the forward timings (default bf16,fp32)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--llama-bin-dir", type=Path, default=None, metavar="DIR",
                   help="where llama.cpp's llama-bench is (default: $SPECSTACK_LLAMA_BIN_DIR, PATH, then "
                        "benchmarks/build_llama_cpp.sh's folder); with a GGUF model it times the same T beside ours")
    p.add_argument("--skip-llama", action="store_true", help="do not run llama-bench")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    p.set_defaults(func=cmd_bench_forward)


def cmd_bench_forward(args: argparse.Namespace) -> int:
    check_threads(args.threads)
    if args.ragged and max(args.rows) < 2:
        raise SpecstackError("--ragged times a prompt chunk beside decoding rows: --rows needs a value of at "
                             f"least 2, got {','.join(map(str, args.rows))}")
    if args.chunk is not None and not args.ragged:
        warn("--chunk does nothing without --ragged")
    check_writable_file(args.out, "--out", parents=True)  # before the work: its result must not be lost
    resolve(args.model)
    from specstack.bench.forward import run_forward_bench  # torch
    from specstack.bench.forward_report import ForwardSettings, batched, report_paths
    from specstack.bench.peers import HF_DTYPES

    if any(d not in HF_DTYPES for d in args.hf_dtypes):
        raise SpecstackError(f"--hf-dtypes: transformers dtypes must be among {', '.join(HF_DTYPES)}, "
                             f"got {','.join(args.hf_dtypes)!r}")
    if batched(args.rows):
        for path in report_paths(args.out):  # the markdown report and the figure, beside --out
            check_writable_file(path, "beside --out,", parents=True)

    settings = ForwardSettings(
        model=args.model, formats=args.formats, tokens=args.tokens, rows=args.rows, ragged=args.ragged,
        chunks=args.chunk or DEFAULT_CHUNKS, context=args.context, repeats=args.repeats,
        warmup=args.warmup, prompts=args.prompts, new_tokens=args.new_tokens, threads=args.threads,
        hf_dtypes=args.hf_dtypes, skip_hf=args.skip_hf, out=args.out, llama_bin_dir=args.llama_bin_dir,
        skip_llama=args.skip_llama)
    run_forward_bench(settings, command_line("bench-forward"))
    return 0
