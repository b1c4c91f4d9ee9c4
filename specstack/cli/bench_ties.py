"""`specstack bench-ties DIR`: is every divergence of a greedy `specstack bench` run a near-tie?

In bf16/int4 a T-token verification forward rounds differently from T one-token forwards, so a
lossless method can part from `ar` (DESIGN §2.1). Where it does, both tokens must be at the top of
the target's logits there: each within a small tolerance of the largest logit (a tie of two, or of
three or more, where rounding picks any of them); anything else is a bug. For every row of an engine
method that is not identical to `ar` at its weight format, this finds the first divergent token,
recomputes the target's logits there (prefill of the prompt and the common prefix) and checks it.
Rows of the peers (transformers, llama.cpp) are other implementations and are not checked.
Exit status 1 when a divergence is not a near-tie.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specstack.cli.common import add_threads_arg


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench-ties", help="check that every divergence from ar in a greedy bench run is a near-tie",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, metavar="DIR", help="a finished `specstack bench` output folder")
    add_threads_arg(p, "torch threads")
    p.set_defaults(func=cmd_bench_ties)


def cmd_bench_ties(args: argparse.Namespace) -> int:
    from specstack.bench.ties import check_folder, report  # torch

    divergences = check_folder(args.dir, args.threads)
    print(report(divergences))
    return 0 if all(d.near_tie for d in divergences) else 1
