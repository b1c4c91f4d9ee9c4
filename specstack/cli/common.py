"""What every command shares: the argument parser, the argument types, and the argument groups that
several commands take (the model to run, the generation settings, the draft sources), each defined once.

Light by contract: this module and every command module import only the standard library and
specstack's light modules (config, errors, the model registry) at their top. A command imports its
logic (engine, models, benchmarks: torch) inside the function that runs it, so `specstack --help` and
the cheap argument errors never import torch (tests/cli/test_cli_light.py).

Cheap checks (numbers, files, the model name, the device) run before anything heavy is loaded; bad
input raises SpecstackError, which `main` (app.py) prints as one line. Numbers are checked as they are
parsed, by the rules in specstack/validate.py (the ones the server will apply to requests): an option
added with `add_checked` passes its text to its rule, whose error names the flag. A flag that is
allowed but does not do what its user may think (more threads than cores, a draft for a method that
reads none) gets one `specstack: warning: ...` line on stderr (`warn`).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from specstack import validate
from specstack.config import DEVICES, SamplingParams
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL, resolve
from specstack.weight_formats import FALLBACK_FORMAT, WEIGHT_FORMATS

if TYPE_CHECKING:
    from specstack.engine.methods import MethodSpec

T = TypeVar("T")

PROG = "specstack"
DTYPE_HELP = ("weight format (default on cpu: w4a8 where this CPU has its native kernels, AVX-512-VNNI or AVX2: "
              "exact, every method equals ar, and a faster one-token step than int4 where measured; int4 "
              "elsewhere. bf16 on cuda)")
MODEL_HELP = f"registry name, .gguf file or Hugging Face checkpoint directory (default: {DEFAULT_MODEL})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as a SpecstackError (one line, exit 2) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise SpecstackError(f"{message} (see '{self.prog} --help')")


def warn(message: str | None) -> None:
    """One line `specstack: warning: MESSAGE` on stderr (nothing for None): the run goes on."""
    if message is not None:
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------------
def add_checked(g: argparse._ActionsContainer, flag: str, rule: validate.Rule[T], **kwargs: Any) -> None:
    """Add option `flag`, its text checked by `rule(flag, text)` (specstack/validate.py) as it is
    parsed. The rule's SpecstackError names the flag and leaves argparse untouched (argparse rewords
    only ValueError and ArgumentTypeError), so `main` prints it as the one error line."""
    g.add_argument(flag, type=lambda text: rule(flag, text), **kwargs)


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers (sizes: each at most validate.MAX_CONTEXT), each once, in order."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {validate.shown(text)}") from None
    if not values or any(not 0 < v <= validate.MAX_CONTEXT for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers up to {validate.MAX_CONTEXT}, "
                                         f"got {validate.shown(text)}")
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
    g.add_argument("--dtype", choices=WEIGHT_FORMATS, default=None, help=DTYPE_HELP)
    g.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    add_threads_arg(g, threads_help)


def add_threads_arg(g: argparse._ActionsContainer, help_text: str, default: int | None = None) -> None:
    """--threads N: 1 .. validate.MAX_THREADS; more than the cores is allowed with a warning (check_threads)."""
    add_checked(g, "--threads", validate.threads, default=default, metavar="N", help=help_text)


def check_threads(threads: int | None) -> None:
    """Warn (once: a command calls this once) when --threads is more than the cores."""
    warn(validate.threads_warning("--threads", threads))


def add_generation_args(p: argparse.ArgumentParser, exact: bool = False) -> None:
    """--max-new-tokens and the sampling flags (sampling_params). exact: every generation makes exactly
    N tokens, EOS included (a benchmark's equal work), so there is no --stop."""
    g = p.add_argument_group("generation")
    add_checked(g, "--max-new-tokens", validate.new_tokens, default=128, metavar="N",
                help="tokens per generation, exactly (default: 128)" if exact else "default: 128")
    add_checked(g, "--temperature", validate.temperature, default=0.0, help="0 (default) = greedy decoding")
    add_checked(g, "--top-k", validate.top_k, default=0, help="keep the k most likely tokens (default 0: off)")
    add_checked(g, "--top-p", validate.top_p, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    add_checked(g, "--seed", validate.seed, default=None, help="random seed for sampling (0 .. 2**64 - 1)")
    if not exact:
        add_checked(g, "--stop", validate.stop_string, action="append", default=[], metavar="STR",
                    help="stop when the output contains STR (repeatable)")


def add_draft_args(g: argparse._ActionsContainer) -> None:
    """--draft, --draft-dtype, --ngram: where the drafts come from (engine.draft_sources.DraftSources)."""
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft: a model (shares the tokenizer), a trained draft FILE.safetensors "
                        "(specstack train-draft), a draft shipped for the target by name (spire), self:N = the "
                        "target's first N layers, or magicdec:W = the target itself with a sliding-window KV of "
                        "W tokens (default for smollm2-135m: the shipped SPIRe draft; for qwen2.5-coder-1.5b: "
                        "qwen2.5-coder-0.5b)")
    g.add_argument("--draft-dtype", choices=WEIGHT_FORMATS, default=None,
                   help="the draft's weight format (default: int8 for a trained draft; for a model or self:N "
                        "draft the default --dtype: w4a8 where its kernels build, int4 elsewhere)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="FR-Spec: the draft's head over the target's K most frequent tokens (a cheaper draft "
                        "step; the target still verifies every token, so the output is the same); default for "
                        "qwen2.5-coder-1.5b: 32768; 0: the full vocabulary")
    g.add_argument("--ngram", default=None, metavar="FILE",
                   help="trigram file for ngram/staged (default: the shipped one for the model)")


# ---------------------------------------------------------------------------------------------------
# Checks and conversions of those groups
# ---------------------------------------------------------------------------------------------------
def check_model_args(args: argparse.Namespace) -> str:
    """Checks the model name and device without loading anything (warns of more threads than cores);
    returns the weight format."""
    resolve(args.model)  # unknown names and missing paths fail here, before any weights are read
    check_threads(args.threads)
    if args.device == "cuda":
        import torch  # only asked for cuda: the cpu path stays torch-free until the model loads

        if not torch.cuda.is_available():
            raise SpecstackError("--device cuda: no CUDA device is available (this torch build or machine has none)")
    return args.dtype or default_dtype(args.device)


def default_dtype(device: str) -> str:
    """The weight format when --dtype is not given (models/quant.default_format: w4a8 where this CPU has
    its native kernels, int4 elsewhere, bf16 on CUDA)."""
    if device != "cpu":
        return FALLBACK_FORMAT[device]
    from specstack.models.quant import default_format  # torch: after the cheap checks, as the model's load is next

    return default_format(device)


def warn_ignored_draft_args(args: argparse.Namespace, method: MethodSpec) -> None:
    """--draft, --draft-dtype or --ngram given to a method that reads none of them: a warning, not an
    error (a script may pass the same flags to every method it runs)."""
    from specstack.engine.methods import DraftSources, ignored_sources  # parse_method imported it already

    for name in ignored_sources(method, DraftSources(args.draft, args.draft_dtype, args.ngram, args.draft_vocab)):
        warn(f"--{name.replace('_', '-')} is ignored: method {method.name!r} does not use it")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags of add_generation_args (checked as they were parsed)."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def command_line(command: str) -> str:
    """This run as one `specstack COMMAND ...` line (what benchmark reports record to reproduce it)."""
    argv = sys.argv[1:]
    return shlex.join([PROG, *argv]) if argv[:1] == [command] else shlex.join([PROG, command, *argv])


def sizes(high: int, example: str, why: str = "") -> validate.Rule[list[int]]:
    """Comma-separated integers in 1 .. high, each once, in order (--rows, --chunk, --batch-sizes)."""

    def parse(name: str, text: str) -> list[int]:
        items = [x.strip() for x in text.split(",")]
        if not any(items):
            validate.fail(name, f"needs at least one value, e.g. {example}")
        if not all(items):
            validate.fail(name, f"must be comma-separated integers, got {validate.shown(text)}")
        return list(dict.fromkeys(validate.bounded_int(name, x, 1, high, why) for x in items))

    return parse
