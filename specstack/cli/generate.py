"""`specstack generate`: generate text from a prompt, streaming it to stdout.

A thin adapter (DESIGN §1): parse and check the arguments, load the model, encode the prompt, call the
engine, print. No decoding logic lives here. Cheap checks (numbers, the prompt file, the model name,
the device) run before the model is loaded, so a typo fails in well under a second; torch and the
engine are imported only once they are needed (common.py).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack.cli.common import (
    add_draft_args,
    add_generation_args,
    add_model_args,
    check_model_args,
    sampling_params,
    warn_ignored_draft_args,
)
from specstack.config import GenerationConfig
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_file, read_text
from specstack.prompts import check_context, encode_prompt

if TYPE_CHECKING:
    from specstack.drafting.base import Drafter
    from specstack.engine.autoregressive import GenerationResult
    from specstack.engine.methods import MethodSpec
    from specstack.models.base import LoadedModel


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, streaming it to stdout",
                              description="Generate text from a prompt; the text streams to stdout, a stats line "
                                          "goes to stderr.")
    add_model_args(p)
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from a UTF-8 text file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_generation_args(p)
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--method", default="ar", metavar="NAME[:k=v,...]",
                   help="ar (default), chain[:k=4], tree[:width=4,budget=36,depth=8,expand=4,cost=0], "
                        "ngram[:width=1,depth=3,max=0,cost=0,match=3], "
                        "staged[:width=4,budget=36,depth=8,cost=0,d2=0] (see README)")
    add_draft_args(g)
    g.add_argument("--show-origins", action="store_true",
                   help="print the output coloured by token origin (target / draft / draft2 / context)")
    g.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the token-origin view as a page")
    p.set_defaults(func=cmd_generate)


# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------
def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The sampling and stopping settings; SamplingParams / GenerationConfig validate the numbers."""
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling_params(args),
                            stop_strings=tuple(args.stop))


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt or --prompt-file (strict UTF-8; a leading BOM is dropped)."""
    if args.prompt_file is None:
        text, what = args.prompt, "the prompt"
    else:
        text, what = read_text(args.prompt_file, "prompt file"), f"the prompt file {args.prompt_file}"
    if not text.strip():
        raise SpecstackError(f"{what} is empty")
    return text


def load(args: argparse.Namespace, dtype: str) -> LoadedModel:
    import torch

    from specstack.models.loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=dtype, device=args.device)


def encode(lm: LoadedModel, text: str, chat: bool) -> list[int]:
    ids = encode_prompt(lm.tokenizer, text, chat=chat)
    check_context(len(ids), lm.config.max_seq_len)
    return ids


def build_method(args: argparse.Namespace, method: MethodSpec, lm: LoadedModel) -> Drafter | None:
    from specstack.engine.methods import DraftSources, build_drafter

    sources = DraftSources.for_model(lm.name, args.draft, args.draft_dtype, args.ngram)
    return build_drafter(method, lm, sources, args.device)


def run_generation(lm: LoadedModel, prompt_ids: list[int], gen: GenerationConfig,
                   on_text: Callable[[str], None], drafter: Drafter | None = None) -> GenerationResult:
    """The one method-dependent step: autoregressive without a drafter, else speculative."""
    from specstack.engine.methods import run_method

    return run_method(lm, drafter, prompt_ids, gen, on_text=on_text)


def print_text(text: str) -> None:
    """The on_text callback: show each piece of text as soon as the engine releases it."""
    sys.stdout.write(text)
    sys.stdout.flush()


def finish_output(result: GenerationResult) -> None:
    if result.text and not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(result.stats.line(), file=sys.stderr, flush=True)


def show_origins(args: argparse.Namespace, lm: LoadedModel, result: GenerationResult) -> None:
    from specstack.report.origins import ansi, html_page, token_origins, token_pieces

    pieces = token_pieces(lm.tokenizer, result.tokens)
    origins = token_origins(result.stats, len(result.tokens))
    if args.show_origins:
        print(ansi(pieces, origins), file=sys.stderr, flush=True)
    if args.html is not None:
        title = f"specstack {args.method} on {lm.name}"
        atomic_write_text(args.html, html_page(pieces, origins, title, result.stats.line()))


def cmd_generate(args: argparse.Namespace) -> int:
    # 1. cheap checks, before any weights are read (the torch-free ones first)
    gen = generation_config(args)
    text = read_prompt(args)
    dtype = check_model_args(args)
    if args.html is not None:
        check_writable_file(args.html, "--html")
    from specstack.engine.methods import parse_method

    method = parse_method(args.method)
    warn_ignored_draft_args(args, method)
    # 2. load and encode (the context check needs the tokenizer and the model's limit)
    lm = load(args, dtype)
    prompt_ids = encode(lm, text, args.chat)
    drafter = build_method(args, method, lm)
    # 3. generate, streaming to stdout; stats to stderr
    result = run_generation(lm, prompt_ids, gen, on_text=print_text, drafter=drafter)
    finish_output(result)
    if args.show_origins or args.html is not None:
        show_origins(args, lm, result)
    return 0
