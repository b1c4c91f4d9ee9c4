"""Command line: `specstack generate ...`.

A thin adapter (DESIGN §1): parse and check the arguments, load the model, encode the prompt, call the
engine, print. No decoding logic lives here.

Errors: bad input raises SpecstackError (from here or from any layer below); `main` prints it as one
line `specstack: error: <message>` on stderr and returns 2. argparse's own errors (unknown flag, bad
choice, missing value) go the same way. Ctrl-C returns 130 without a traceback. Any other exception is
a bug and keeps its traceback.

Cheap checks (numbers, the prompt file, the model name, the device) run before the model is loaded, so
a typo fails in well under a second; torch and transformers are imported only once they are needed.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from specstack.config import DEVICES, WEIGHT_FORMATS, GenerationConfig, SamplingParams
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from specstack.engine.autoregressive import GenerationResult
    from specstack.models.loading import LoadedModel

PROG = "specstack"
# The default weight format per device: int4 has the fastest one-token step on CPU (DESIGN §3 table);
# on CUDA bf16 is the plain fast format.
DEFAULT_DTYPE = {"cpu": "int4", "cuda": "bf16"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as a SpecstackError (one line, exit 2) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise SpecstackError(f"{message} (see '{self.prog} --help')")


# ---------------------------------------------------------------------------------------------------
# Argument types and groups (shared by subcommands to come)
# ---------------------------------------------------------------------------------------------------
def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name, .gguf file or Hugging Face checkpoint directory (default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", choices=WEIGHT_FORMATS, default=None,
                   help="weight format (default: int4 on cpu, the fastest one-token step there; bf16 on cuda)")
    g.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's own choice)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from a UTF-8 text file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: 128")
    g.add_argument("--temperature", type=_finite_float, default=0.0, help="0 (default) = greedy decoding")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--top-p", type=_finite_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the output contains STR (repeatable)")


def add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--method", default="ar", metavar="NAME[:k=v,...]",
                   help="ar (default), chain[:k=4], tree[:width=4,budget=36,depth=8,expand=4,cost=0], "
                        "ngram[:width=1,depth=3,max=0,cost=0,match=3], "
                        "staged[:width=4,budget=36,depth=8,cost=0,d2=0] (see README)")
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
    g.add_argument("--show-origins", action="store_true",
                   help="print the output coloured by token origin (target / draft / draft2 / context)")
    g.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the token-origin view as a page")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Lossless speculative decoding engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it to stdout",
                         description="Generate text from a prompt; the text streams to stdout, a stats line "
                                     "goes to stderr.")
    add_model_args(gen)
    add_prompt_args(gen)
    add_generation_args(gen)
    add_method_args(gen)
    gen.set_defaults(func=cmd_generate)
    from specstack.bench import (
        forward as bench_forward,  # light: imports torch only when run
    )

    bench_forward.add_parser(sub)  # `specstack bench-forward`
    from specstack.bench import (
        run as bench_run,  # light: torch and the models only when run
    )

    bench_run.add_parser(sub)  # `specstack bench`
    from specstack.bench import (
        ties as bench_ties,  # light: torch and the model only when run
    )

    bench_ties.add_parser(sub)  # `specstack bench-ties`
    from specstack.cli import ngram as ngram_cli  # light: numpy/tokenizers only when run

    ngram_cli.add_parser(sub)  # `specstack ngram train`
    from specstack.cli import throughput as throughput_cli  # light: torch only for --tau auto, calibrate and check

    throughput_cli.add_parser(sub)  # `specstack throughput`, `throughput-calibrate`, `throughput-check`
    from specstack.cli import train_draft as train_cli  # light: torch only when run

    train_cli.add_parser(sub)  # `specstack train-draft`
    from specstack.cli import draft_acceptance as acceptance_cli  # light: torch only when run

    acceptance_cli.add_parser(sub)  # `specstack draft-acceptance`
    return parser


# ---------------------------------------------------------------------------------------------------
# Method-independent steps
# ---------------------------------------------------------------------------------------------------
def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The sampling and stopping settings; SamplingParams / GenerationConfig validate the numbers."""
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_strings=tuple(args.stop))


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt or --prompt-file (strict UTF-8; a leading BOM is dropped)."""
    if args.prompt_file is None:
        text, what = args.prompt, "the prompt"
    else:
        path: Path = args.prompt_file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SpecstackError(f"prompt file not found: {path}") from None
        except IsADirectoryError:
            raise SpecstackError(f"prompt file is a directory: {path}") from None
        except OSError as e:
            raise SpecstackError(f"cannot read prompt file {path}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SpecstackError(f"prompt file {path} is not valid UTF-8 (byte 0x{data[e.start]:02x} "
                                 f"at offset {e.start})") from None
        what = f"the prompt file {path}"
    if not text.strip():
        raise SpecstackError(f"{what} is empty")
    return text


def check_runtime(args: argparse.Namespace) -> str:
    """Checks the model name, device and threads without loading anything; returns the weight format."""
    from specstack.models.registry import resolve

    resolve(args.model)  # unknown names and missing paths fail here, before any weights are read
    if args.threads is not None and args.threads < 1:
        raise SpecstackError(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SpecstackError("--device cuda: no CUDA device is available (this torch build or machine has none)")
    return args.dtype or DEFAULT_DTYPE[args.device]


def load(args: argparse.Namespace, dtype: str) -> LoadedModel:
    import torch

    from specstack.models.loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=dtype, device=args.device)


def encode(lm: LoadedModel, text: str, chat: bool) -> list[int]:
    from specstack.prompts import check_context, encode_prompt

    ids = encode_prompt(lm.tokenizer, text, chat=chat)
    check_context(len(ids), lm.config.max_seq_len)
    return ids


def print_text(text: str) -> None:
    """The on_text callback: show each piece of text as soon as the engine releases it."""
    sys.stdout.write(text)
    sys.stdout.flush()


def finish_output(result: GenerationResult) -> None:
    if result.text and not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(result.stats.line(), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------------
def run_generation(lm: LoadedModel, prompt_ids: list[int], gen: GenerationConfig,
                   on_text: Callable[[str], None], drafter=None) -> GenerationResult:
    """The one method-dependent step: autoregressive without a drafter, else speculative."""
    from specstack.engine.methods import run_method

    return run_method(lm, drafter, prompt_ids, gen, on_text=on_text)


def build_method(args: argparse.Namespace, lm: LoadedModel):  # -> Drafter | None
    from specstack.engine.methods import DraftSources, build_drafter

    sources = DraftSources.for_model(lm.name, args.draft, args.draft_dtype, args.ngram)
    return build_drafter(args.method_spec, lm, sources, args.device)


def show_origins(args: argparse.Namespace, lm: LoadedModel, result: GenerationResult) -> None:
    from specstack.report.origins import ansi, html_page, token_origins, token_pieces

    pieces = token_pieces(lm.tokenizer, result.tokens)
    origins = token_origins(result.stats, len(result.tokens))
    if args.show_origins:
        print(ansi(pieces, origins), file=sys.stderr, flush=True)
    if args.html is not None:
        title = f"specstack {args.method} on {lm.name}"
        args.html.write_text(html_page(pieces, origins, title, result.stats.line()), encoding="utf-8")


def cmd_generate(args: argparse.Namespace) -> int:
    from specstack.engine.methods import parse_method

    # 1. cheap checks, before any weights are read
    gen = generation_config(args)
    args.method_spec = parse_method(args.method)
    text = read_prompt(args)
    dtype = check_runtime(args)
    if args.html is not None and not args.html.parent.is_dir():
        raise SpecstackError(f"--html: folder {args.html.parent} does not exist")
    # 2. load and encode (the context check needs the tokenizer and the model's limit)
    lm = load(args, dtype)
    prompt_ids = encode(lm, text, args.chat)
    drafter = build_method(args, lm)
    # 3. generate, streaming to stdout; stats to stderr
    result = run_generation(lm, prompt_ids, gen, on_text=print_text, drafter=drafter)
    finish_output(result)
    if args.show_origins or args.html is not None:
        show_origins(args, lm, result)
    return 0


# ---------------------------------------------------------------------------------------------------
def error_line(message: str) -> str:
    return f"{PROG}: error: " + " ".join(str(message).split())  # always one line


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SpecstackError as e:
        print(error_line(str(e)), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit
        try:
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1
    except SystemExit as e:  # --help and --version exit through argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    raise SystemExit(main())
