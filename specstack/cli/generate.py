"""`specstack generate`: generate text from a prompt, streaming it to stdout; or many rows at once.

A thin adapter (DESIGN §1): parse and check the arguments, load the model, encode the prompt, call the
engine, print. No decoding logic lives here. Cheap checks (numbers, the prompt file, the model name,
the device) run before the model is loaded, so a typo fails in well under a second; torch and the
engine are imported only once they are needed (common.py).

One row (one prompt, no --n) streams through the single-sequence engine, as it always has. More rows
(--n samples of a prompt, or a prompt file of many: `.jsonl`, or --per-line) decode together in the
batched engine (engine/batched.py), --batch-size at a time, every method speculating in batch (BASS);
batch_output.py prints them in input order. The method defaults to `auto` (engine/methods.py), and the
stats line names what ran.
Every prompt is read, checked and encoded before the first row decodes, so a bad one among many fails
the run at once, naming its line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack import validate
from specstack.cli.batch_output import RowKey, RowPrinter, json_line, total_line
from specstack.cli.common import (
    add_checked,
    add_draft_args,
    add_generation_args,
    add_model_args,
    check_model_args,
    sampling_params,
    warn,
    warn_ignored_draft_args,
)
from specstack.cli.rules import add_rules_args, rules
from specstack.config import GenerationConfig
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, check_writable_file, read_text
from specstack.fim import ExtraFile
from specstack.prompts import check_context, check_text, encode_prompt

if TYPE_CHECKING:
    from specstack.drafting.base import Drafter
    from specstack.drafting.batch_length import BatchLength
    from specstack.engine.methods import MethodSpec
    from specstack.engine.stats import GenerationResult
    from specstack.models.base import LoadedModel

DEFAULT_BATCH_SIZE = 8


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, streaming it to stdout",
                              description="Generate text from a prompt; the text streams to stdout, a stats line "
                                          "goes to stderr.")
    add_model_args(p)
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, metavar="PATH",
                     help="read the prompt from a UTF-8 text file (all of it is one prompt); a FILE.jsonl holds "
                          'one prompt per line: a JSON string or an object with a "prompt" string')
    g.add_argument("--per-line", action="store_true",
                   help="a plain --prompt-file holds one prompt per non-empty line (a .jsonl file always does)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g = p.add_argument_group("fill in the middle (code completion at a cursor; the prompt is the code before it)")
    fim = g.add_mutually_exclusive_group()
    fim.add_argument("--suffix", default=None, metavar="TEXT",
                     help="the code after the cursor: the model writes what goes between the prompt and this, "
                          "from its own FIM tokens (e.g. qwen2.5-coder-1.5b)")
    fim.add_argument("--suffix-file", type=Path, default=None, metavar="PATH", help="read --suffix from a UTF-8 file")
    g.add_argument("--extra-file", type=Path, action="append", default=[], metavar="PATH",
                   help="another file of the project the model sees first (repeatable; the repository layout)")
    add_generation_args(p)
    g = p.add_argument_group("several rows (decoded together in a batch)")
    add_checked(g, "--n", validate.ints(1, validate.MAX_COUNT), default=1, metavar="N",
                help="samples per prompt (default 1); with --seed S, sample i (from 0) uses seed S + i")
    add_checked(g, "--batch-size", validate.ints(1, validate.MAX_BATCH_SIZE, "each row holds a KV cache of its context"),
                default=None, metavar="B", help=f"rows decoding at once (default: {DEFAULT_BATCH_SIZE}, or fewer "
                                                "rows); a finished row's slot takes the next at once")
    g.add_argument("--jsonl", action="store_true",
                   help="print one JSON object per row on stdout (prompt_index and sample count from 0) instead "
                        "of a '### prompt P, sample S' header before each row's text")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--method", default="auto", metavar="NAME[:k=v,...]",
                   help="auto (default: the fastest lossless choice measured here, the cost-aware n-gram chain), "
                        "ar, chain[:k=4,max=0,cost=0], tree[:width=4,budget=36,depth=8,expand=4,cost=0,shared=1], "
                        "ngram[:width=1,depth=3,max=0,cost=0,match=3], "
                        "staged[:width=4,budget=36,depth=8,cost=0,d2=0,shared=0] (see docs/methods.md)")
    add_draft_args(g)
    g.add_argument("--show-origins", action="store_true",
                   help="print the output coloured by token origin (target / draft / draft2 / context)")
    g.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the token-origin view as a page")
    add_rules_args(p)
    p.set_defaults(func=cmd_generate)


# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------
def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The sampling and stopping settings; SamplingParams / GenerationConfig validate the numbers."""
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling_params(args),
                            stop_strings=tuple(args.stop), **rules(args))


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # how an error names it: "FILE line K" for a prompt among many


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts, each checked (not empty, valid text): --prompt or a whole --prompt-file is one; a
    `.jsonl` file holds one per line, a --per-line file one per non-empty line."""
    path = args.prompt_file
    if path is None or (path.suffix.lower() != ".jsonl" and not args.per_line):
        if args.per_line:
            raise SpecstackError("--per-line splits a --prompt-file into prompts; --prompt is one prompt")
        return [Prompt(read_prompt(args), "the prompt")]
    text = read_text(path, "prompt file")
    prompts = jsonl_prompts(path, text) if path.suffix.lower() == ".jsonl" else line_prompts(path, text)
    if not prompts:
        raise SpecstackError(f"the prompt file {path} holds no prompts")
    return prompts


def file_lines(text: str) -> list[str]:
    """Lines split at \\n only (a JSON string may hold U+2028, which str.splitlines would split at)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def line_prompts(path: Path, text: str) -> list[Prompt]:
    """--per-line: each line with anything but whitespace on it is a prompt, as it is written."""
    return [Prompt(line, f"{path} line {k}") for k, line in enumerate(file_lines(text), 1) if line.strip()]


def jsonl_prompts(path: Path, text: str) -> list[Prompt]:
    """One prompt per non-blank line: a JSON string, or an object whose "prompt" is one."""
    prompts = []
    for k, line in enumerate(file_lines(text), 1):
        if not line.strip():
            continue
        where = f"{path} line {k}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecstackError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError):  # a number of over 4300 digits, arrays nested too deep
            raise SpecstackError(f"{where}: JSON this reader cannot take (a huge number or deep nesting)") from None
        if isinstance(value, dict):
            if "prompt" not in value:
                raise SpecstackError(f'{where}: the object has no "prompt"')
            value = value["prompt"]
        if not isinstance(value, str):
            raise SpecstackError(f'{where}: expected a JSON string or an object with a "prompt" string, '
                                 f"got {type(value).__name__} {validate.shown(value)}")
        prompts.append(Prompt(checked_text(value, where), where))
    return prompts


def checked_text(text: str, where: str) -> str:
    if not text.strip():
        raise SpecstackError(f"{where}: the prompt is empty")
    try:
        check_text(text)  # a JSON escape can spell a lone surrogate
    except SpecstackError as e:
        raise SpecstackError(f"{where}: {e}") from None
    return text


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt or --prompt-file (strict UTF-8; a leading BOM is dropped)."""
    if args.prompt_file is None:
        text, what = args.prompt, "the prompt"
    else:
        text, what = read_text(args.prompt_file, "prompt file"), f"the prompt file {args.prompt_file}"
    if not text.strip():
        raise SpecstackError(f"{what} is empty")
    return text


@dataclass(frozen=True)
class Infill:
    """--suffix / --suffix-file and --extra-file, read and checked before the model loads."""

    suffix: str
    extra: tuple[ExtraFile, ...]


def read_infill(args: argparse.Namespace, prompts: list[Prompt]) -> Infill | None:
    if args.suffix is None and args.suffix_file is None:
        if args.extra_file:
            raise SpecstackError("--extra-file gives context to a fill-in-the-middle run: add --suffix or --suffix-file")
        return None
    if len(prompts) > 1 or args.n > 1:
        raise SpecstackError("--suffix fills one middle: give one prompt (the code before the cursor), without --n")
    if args.chat:
        raise SpecstackError("--suffix and --chat do not go together: a fill-in-the-middle prompt has its own layout")
    suffix = args.suffix if args.suffix_file is None else read_text(args.suffix_file, "suffix file")
    check_text(suffix)
    extra = tuple(ExtraFile(path.name, read_text(path, "extra file")) for path in args.extra_file)
    return Infill(suffix, extra)


def encode_infill(lm: LoadedModel, prefix: str, infill: Infill, gen: GenerationConfig) -> tuple[list[int], GenerationConfig]:
    """The FIM prompt (fitted to the context, leaving the middle its --max-new-tokens where it can) and the
    generation settings that stop at the template's end tokens."""
    from specstack.fim import budget, encode_fim
    from specstack.models.registry import fim_template

    t = fim_template(lm.name, lm.tokenizer)
    p = encode_fim(lm.tokenizer, t, prefix, infill.suffix, infill.extra,
                   budget=budget(lm.config.max_seq_len, gen.max_new_tokens))
    if p.truncated:
        warn("the code around the cursor is longer than the context allows: its far ends were left out")
    return p.ids, dataclasses.replace(gen, stop_ids=t.end_ids(lm.tokenizer))


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


def encode_all(lm: LoadedModel, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    """Every prompt's ids, each checked against the context before any row decodes; an error among
    several prompts names the one (its line)."""
    if len(prompts) == 1:
        return [encode(lm, prompts[0].text, chat)]
    out = []
    for p in prompts:
        try:
            out.append(encode(lm, p.text, chat))
        except SpecstackError as e:
            raise SpecstackError(f"{p.where}: {e}") from None
    return out


def plan_rows(args: argparse.Namespace, prompts: int, gen: GenerationConfig) -> list[RowKey]:
    """Every prompt's --n samples, prompt by prompt; sample i of a prompt gets seed --seed + i (distinct,
    reproducible samples: one of them is the single run with that seed), or none without --seed."""
    n, seed = args.n, gen.sampling.seed
    if prompts * n > validate.MAX_COUNT:
        raise SpecstackError(f"{prompts} prompts x --n {n} = {prompts * n} rows, over {validate.MAX_COUNT}")
    if seed is not None and seed + n - 1 > validate.SEED_MAX:
        raise SpecstackError(f"--seed {seed} with --n {n}: the samples would take seeds up to {seed + n - 1}, "
                             "over 2**64 - 1 (seeds are 64-bit)")
    return [RowKey(p, i, None if seed is None else seed + i) for p in range(prompts) for i in range(n)]


def check_batch_args(args: argparse.Namespace, method: MethodSpec, gen: GenerationConfig, rows: int) -> int:
    """The batch size, once there are several rows; what does not run in a batch fails here, before
    the model loads (and before the warning, so that a refused run prints one line)."""
    what = f"{rows} rows"
    if args.show_origins or args.html is not None:
        raise SpecstackError(f"--show-origins and --html show one generation, not {what}")
    if args.n > 1 and gen.sampling.greedy:
        warn(f"--n {args.n} with greedy decoding (--temperature 0): every sample of a prompt is the same text; "
             "give --temperature T for different samples")
    return min(args.batch_size or DEFAULT_BATCH_SIZE, rows)


@dataclass
class Built:
    """A method made ready: its drafter factory (None: autoregressive) and draft-length rule."""

    drafters: Callable[[], Drafter] | None
    length: BatchLength
    name: str  # what the stats line calls it (`auto` says what it runs)


def build_method(args: argparse.Namespace, method: MethodSpec, lm: LoadedModel, rows: int) -> Built:
    from specstack.engine.methods import DraftSources, describe, drafter_factory, length_rule

    sources = DraftSources.for_model(lm.name, args.draft, args.draft_dtype, args.ngram, args.draft_vocab)
    return Built(drafter_factory(method, lm, sources, args.device), length_rule(method, lm, rows), describe(method, lm.name))


def run_generation(lm: LoadedModel, prompt_ids: list[int], gen: GenerationConfig,
                   on_text: Callable[[str], None], built: Built) -> GenerationResult:
    """The one method-dependent step: autoregressive without a drafter, else speculative."""
    from specstack.engine.batched import generate

    drafter = None if built.drafters is None else built.drafters()
    return generate(lm, prompt_ids, gen, on_text=on_text, length=built.length, drafter=drafter)


def print_text(text: str) -> None:
    """The on_text callback: show each piece of text as soon as the engine releases it."""
    sys.stdout.write(text)
    sys.stdout.flush()


def finish_output(result: GenerationResult, method: str, lm: LoadedModel | None = None) -> None:
    """The text's last line ended; the tokens' log-probabilities if asked for; the stats line last."""
    if result.text and not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if result.logprobs is not None and lm is not None:
        print_logprobs(lm, result)
    print(f"{result.stats.line()}; method {method}" + (f"; weights {weights_of(lm)}" if lm is not None else ""),
          file=sys.stderr, flush=True)


def weights_of(lm: LoadedModel) -> str:
    """The target's weight format and, for the batch-invariant ones, the kernel path this process runs
    (and whether its blocks ran as one native call: models/native_decoder.py)."""
    from specstack.models.quant import weights_label

    label = weights_label(lm.fmt, lm.model.device)
    return label[:-1] + ", native blocks)" if getattr(lm.model, "native_blocks", False) else label


def print_logprobs(lm: LoadedModel, result: GenerationResult) -> None:
    """Each token's log-probability (and its alternatives) on stderr, one line a token."""
    show = lambda t: json.dumps(lm.tokenizer.decode([t]), ensure_ascii=False)  # noqa: E731
    for lp in result.logprobs or []:
        alts = "  ".join(f"{show(t)} {v:.3f}" for t, v in lp.top)
        print(f"{show(lp.token)} {lp.logprob:.4f}" + (f"   [{alts}]" if alts else ""), file=sys.stderr)


def show_origins(args: argparse.Namespace, lm: LoadedModel, result: GenerationResult) -> None:
    from specstack.report.origins import ansi, html_page, token_pieces

    pieces = token_pieces(lm.tokenizer, result.tokens)
    origins = result.origins
    if args.show_origins:
        print(ansi(pieces, origins), file=sys.stderr, flush=True)
    if args.html is not None:
        title = f"specstack {args.method} on {lm.name}"
        atomic_write_text(args.html, html_page(pieces, origins, title, result.stats.line()))


def run_batch(lm: LoadedModel, keys: list[RowKey], ids: list[list[int]], gen: GenerationConfig,
              batch_size: int, jsonl: bool, built: Built) -> None:
    """Decode every row in the batched engine, `batch_size` at a time; print each as the rows before it
    are out, then the total line."""
    from tqdm import tqdm

    from specstack.engine.batched import BatchEngine, BatchRequest

    gens = [gen if key.seed is None else dataclasses.replace(gen, sampling=dataclasses.replace(
        gen.sampling, seed=key.seed)) for key in keys]
    prompts = [ids[key.prompt] for key in keys]
    # the cache holds the longest row (as generate_batch sizes it): a row's new tokens are capped at
    # what the model's context leaves, as for one row
    longest = max(len(p) + g.max_new_tokens for p, g in zip(prompts, gens, strict=True))
    engine = BatchEngine(lm, max_rows=batch_size, max_context=min(lm.config.max_seq_len, longest),
                         length=built.length, drafters=built.drafters)
    # the bar counts finished rows on stderr, only where stderr is a terminal (disable=None)
    with tqdm(total=len(keys), unit="row", desc="generate", file=sys.stderr, disable=None, leave=False) as bar:
        printer = RowPrinter(keys, jsonl, note=lambda line: bar.write(line, file=sys.stderr))
        start = time.perf_counter()
        index = {engine.add(BatchRequest(p, g)): i for i, (p, g) in enumerate(zip(prompts, gens, strict=True))}
        while engine.busy:
            for handle, result in engine.step():
                engine.pop_result(handle)  # the engine keeps finished results until asked
                printer.add(index[handle], result)
                bar.update()
        wall = time.perf_counter() - start
    print(f"{total_line(len(keys), printer.new_tokens, wall, batch_size, engine.stats.phase_seconds())}; "
          f"method {built.name}; weights {weights_of(lm)}", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    # 1. cheap checks, before any weights are read (the torch-free ones first)
    gen = generation_config(args)
    prompts = read_prompts(args)
    keys = plan_rows(args, len(prompts), gen)
    infill = read_infill(args, prompts)
    dtype = check_model_args(args)
    if args.html is not None:
        check_writable_file(args.html, "--html")
    from specstack.engine.methods import parse_method

    method = parse_method(args.method)
    batch_size = check_batch_args(args, method, gen, len(keys)) if len(keys) > 1 else 1
    warn_ignored_draft_args(args, method)
    # 2. load and encode (the context check needs the tokenizer and the model's limit)
    lm = load(args, dtype)
    if infill is not None:
        fim_ids, gen = encode_infill(lm, prompts[0].text, infill, gen)
        ids = [fim_ids]
    else:
        ids = encode_all(lm, prompts, args.chat)
    built = build_method(args, method, lm, batch_size)
    if len(keys) > 1:  # several rows: together in the batched engine
        run_batch(lm, keys, ids, gen, batch_size, args.jsonl, built)
        return 0
    # 3. generate, streaming to stdout; stats to stderr
    if args.jsonl:  # the one row as one JSON line, once it is done
        result = run_generation(lm, ids[0], gen, on_text=lambda _text: None, built=built)
        print(json_line(keys[0], result), flush=True)
        print(f"{result.stats.line()}; method {built.name}; weights {weights_of(lm)}", file=sys.stderr, flush=True)
    else:
        result = run_generation(lm, ids[0], gen, on_text=print_text, built=built)
        finish_output(result, built.name, lm)
    if args.show_origins or args.html is not None:
        show_origins(args, lm, result)
    return 0
