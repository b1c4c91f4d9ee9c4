"""The `specstack` command: one parser, one sub-command per module, one error convention.

A command module (generate.py, bench.py, ...) has `add_parser(subparsers)`, which registers its
sub-command(s) and sets `func`, the function that runs it (args -> exit code). To add a command,
write such a module and list it in COMMANDS.

Errors: bad input raises SpecstackError (from a command or from any layer below); `main` prints it
as one line `specstack: error: <message>` on stderr and returns 2. argparse's own errors (unknown
flag, bad choice, missing value) go the same way (common.ArgumentParser). Ctrl-C stops the run at its
next step (a flag the loops check: specstack/interrupt.py) and returns 130 without a traceback; a
closed stdout (`| head`) returns 1 quietly. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from specstack import interrupt
from specstack.cli import (
    bench,
    bench_forward,
    bench_serve,
    bench_ties,
    doctor,
    draft_acceptance,
    generate,
    ngram,
    serve,
    throughput,
    train_draft,
)
from specstack.cli.common import PROG, ArgumentParser
from specstack.errors import SpecstackError

# in the order `specstack --help` lists them
COMMANDS: tuple[ModuleType, ...] = (generate, serve, bench_serve, bench_forward, bench, bench_ties, ngram, throughput,
                                    train_draft, draft_acceptance, doctor)


class VersionAction(argparse.Action):
    """--version: `specstack <version>` of the installed package (read only when asked: it scans the
    installed distributions)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version(PROG)
        except PackageNotFoundError:  # run from a source tree that is not installed
            from specstack import __version__ as v
        print(f"{PROG} {v}")
        parser.exit()


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Lossless speculative decoding engine.")
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def error_line(message: str) -> str:
    return f"{PROG}: error: " + " ".join(str(message).split())  # always one line


def main(argv: Sequence[str] | None = None) -> int:
    with interrupt.handling_sigint():  # Ctrl-C: stop at the next step (specstack/interrupt.py)
        try:
            interrupt.check()  # a Ctrl-C while the commands were imported (specstack/cli/__init__.py)
            args = build_parser().parse_args(argv)
            code = args.func(args)
            interrupt.check()  # a Ctrl-C after the last step still ends the run as interrupted
            return code
        except SpecstackError as e:
            print(error_line(str(e)), file=sys.stderr, flush=True)
            return 2
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # the reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
            return 1
        except SystemExit as e:  # --help and --version exit through argparse
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
