"""`specstack doctor`: what this machine has and what specstack chose on it, as a report.

    specstack doctor [--json]

Five sections: the machine (CPU, the instruction sets that matter, torch), what specstack chose on this CPU
(the default --dtype, each kernel table's entry and the variable that forces one, the native kernels),
the cache folder, the installed extras and llama.cpp peer binaries, the registered models; then one line:
everything OK, or the problems with their fixes. Read only and fast: nothing is compiled, assembled or
loaded (the package specstack/doctor gathers it). A report, so its exit status is 0 whatever it finds.
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="report this machine, what specstack chose on it, and what is missing",
                              description="Report the CPU's instruction sets, the default weight format and kernels "
                                          "specstack chose on it, the cache folder, the installed extras, peer "
                                          "binaries and models, and each problem with its fix. Builds nothing.")
    p.add_argument("--json", action="store_true", help="print one JSON object with the same fields")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specstack import doctor  # torch: only once the command runs (cli/common.py's contract)

    report = doctor.gather()
    print(json.dumps(doctor.to_json(report), indent=2) if args.json else doctor.render(report), flush=True)
    return 0  # a report: what it finds is in its text, not in the exit status
