"""What every command shares: the argument parser, the argument types, and the argument groups that
several commands take (the model to run, the generation settings, the draft sources), each defined once.

Light by contract: this module and every command module import only the standard library and
specstack's light modules (config, errors, the model registry) at their top. A command imports its
logic (engine, models, benchmarks: torch) inside the function that runs it, so `specstack --help` and
the cheap argument errors never import torch (tests/cli/test_cli_light.py).

Cheap checks (numbers, files, the model name, the device) run before anything heavy is loaded; bad
input raises SpecstackError, which `main` (app.py) prints as one line.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from specstack.config import DEVICES, WEIGHT_FORMATS, SamplingParams
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL, resolve

PROG = "specstack"
# The default weight format per device: int4 has the fastest one-token step on CPU (DESIGN §3 table);
# on CUDA bf16 is the plain fast format.
DEFAULT_DTYPE = {"cpu": "int4", "cuda": "bf16"}
MODEL_HELP = f"registry name, .gguf file or Hugging Face checkpoint directory (default: {DEFAULT_MODEL})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as a SpecstackError (one line, exit 2) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise SpecstackError(f"{message} (see '{self.prog} --help')")


# ---------------------------------------------------------------------------------------------------
# Argument types (argparse turns their ArgumentTypeError into a one-line error)
# ---------------------------------------------------------------------------------------------------
def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, each once, in order."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A type for comma-separated names from `choices` (at least one, each once, in order)."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(choices)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse


def parse_contexts(text: str, seq_len: int) -> tuple[int, ...]:
    """--contexts C1,C2,... of train-draft and draft-acceptance: buckets within a sequence (may be empty)."""
    try:
        contexts = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise SpecstackError(f"--contexts must be comma-separated integers, got {text!r}") from None
    bad = [c for c in contexts if not 2 <= c <= seq_len]
    if bad:
        raise SpecstackError(f"--contexts {bad}: each must lie in [2, --seq-len {seq_len}]")
    return contexts


# ---------------------------------------------------------------------------------------------------
# Argument groups
# ---------------------------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser,
                   threads_help: str = "CPU threads for torch (default: torch's own choice)") -> None:
    """--model, --dtype, --device, --threads: the target and where it runs (checked by check_model_args)."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--dtype", choices=WEIGHT_FORMATS, default=None,
                   help="weight format (default: int4 on cpu, the fastest one-token step there; bf16 on cuda)")
    g.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    g.add_argument("--threads", type=int, default=None, metavar="N", help=threads_help)


def add_generation_args(p: argparse.ArgumentParser, exact: bool = False) -> None:
    """--max-new-tokens and the sampling flags (sampling_params). exact: every generation makes exactly
    N tokens, EOS included (a benchmark's equal work), so there is no --stop."""
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens per generation, exactly (default: 128)" if exact else "default: 128")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="0 (default) = greedy decoding")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    if not exact:
        g.add_argument("--stop", action="append", default=[], metavar="STR",
                       help="stop when the output contains STR (repeatable)")


def add_draft_args(g: argparse._ActionsContainer) -> None:
    """--draft, --draft-dtype, --ngram: where the drafts come from (engine.methods.DraftSources)."""
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft: a model (shares the tokenizer), a trained draft FILE.safetensors "
                        "(specstack train-draft), self:N = the target's first N layers, or magicdec:W = the "
                        "target itself with a sliding-window KV of W tokens (default for smollm2-135m: the "
                        "shipped SPIRe draft)")
    g.add_argument("--draft-dtype", choices=WEIGHT_FORMATS, default=None,
                   help="the draft's weight format (default: int8 for a trained draft, int4 for a model or "
                        "self:N draft)")
    g.add_argument("--ngram", default=None, metavar="FILE",
                   help="trigram file for ngram/staged (default: the shipped one for the model)")


# ---------------------------------------------------------------------------------------------------
# Checks and conversions of those groups
# ---------------------------------------------------------------------------------------------------
def check_model_args(args: argparse.Namespace) -> str:
    """Checks the model name, threads and device without loading anything; returns the weight format."""
    resolve(args.model)  # unknown names and missing paths fail here, before any weights are read
    if args.threads is not None and args.threads < 1:
        raise SpecstackError(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda":
        import torch  # only asked for cuda: the cpu path stays torch-free until the model loads

        if not torch.cuda.is_available():
            raise SpecstackError("--device cuda: no CUDA device is available (this torch build or machine has none)")
    return args.dtype or DEFAULT_DTYPE[args.device]


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags of add_generation_args; SamplingParams validates the numbers."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def command_line(command: str) -> str:
    """This run as one `specstack COMMAND ...` line (what benchmark reports record to reproduce it)."""
    argv = sys.argv[1:]
    return shlex.join([PROG, *argv]) if argv[:1] == [command] else shlex.join([PROG, command, *argv])
