"""`specstack generate`'s logits rules and log-probabilities: --logprobs, --json / --json-schema FILE /
--regex RE / --grammar FILE (one output grammar), --presence-penalty, --frequency-penalty,
--repetition-penalty, --logit-bias ID=BIAS. Each is checked as it is parsed or before the model loads
(a schema file that is not a JSON object names the file); a grammar that does not compile is refused
when the request is queued, before the first token. Standard library only (the light CLI)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specstack import validate
from specstack.cli.common import add_checked
from specstack.config import MAX_BIAS, MAX_LOGPROBS, GrammarSpec, Penalties
from specstack.errors import SpecstackError
from specstack.files import read_text


def add_rules_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output, penalties, log-probabilities (applied per draft-tree node: lossless)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json", action="store_true", help="the output is one JSON object")
    one.add_argument("--json-schema", type=Path, default=None, metavar="FILE", help="the output is JSON valid for this schema")
    one.add_argument("--regex", default=None, metavar="RE", help="the output matches this regular expression")
    one.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                     help="the output follows this Lark grammar (llguidance's dialect; may embed %%json{...})")
    add_checked(g, "--presence-penalty", lambda n, v: validate.bounded_float(n, v, -2.0, 2.0), default=0.0,
                metavar="X", help="subtracted from a token's logit once it was generated (OpenAI's; -2 .. 2)")
    add_checked(g, "--frequency-penalty", lambda n, v: validate.bounded_float(n, v, -2.0, 2.0), default=0.0,
                metavar="X", help="subtracted per time a token was generated (OpenAI's; -2 .. 2)")
    add_checked(g, "--repetition-penalty", lambda n, v: validate.bounded_float(n, v, 0.0, 2.0, low_open=True),
                default=1.0, metavar="X", help="a seen token's logit divided (>0) or multiplied (<0) by X (vLLM's)")
    add_checked(g, "--logit-bias", bias_entry, action="append", default=[], metavar="ID=BIAS",
                help="add BIAS (-100 .. 100) to token ID's logit (repeatable)")
    add_checked(g, "--logprobs", lambda n, v: validate.bounded_int(n, v, 0, MAX_LOGPROBS), default=None,
                metavar="N", help="each token's log-probability and the N most likely (--jsonl rows carry them; "
                                  "otherwise they are listed on stderr)")


def bias_entry(name: str, text: object) -> tuple[int, float]:
    token, sep, bias = str(text).partition("=")
    if not sep:
        validate.fail(name, f"is ID=BIAS, got {validate.shown(text)}")
    return (validate.bounded_int(name, token.strip(), 0),
            validate.bounded_float(name, bias.strip(), -MAX_BIAS, MAX_BIAS))


def grammar_spec(args: argparse.Namespace) -> GrammarSpec | None:
    """The output grammar the flags ask for (files read and checked here)."""
    if args.json:
        return GrammarSpec("json_object")
    if args.json_schema is not None:
        text = read_text(args.json_schema, "--json-schema file")
        try:
            schema: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecstackError(f"--json-schema {args.json_schema}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(schema, dict):
            raise SpecstackError(f"--json-schema {args.json_schema}: a JSON schema is an object")
        return GrammarSpec("json_schema", text)
    if args.regex is not None:
        if not args.regex:
            raise SpecstackError("--regex is empty")
        return GrammarSpec("regex", args.regex)
    if args.grammar is not None:
        text = read_text(args.grammar, "--grammar file")
        if not text.strip():
            raise SpecstackError(f"--grammar {args.grammar} is empty")
        return GrammarSpec("lark", text)
    return None


def rules(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationConfig's fields for the flags."""
    return {"logprobs": args.logprobs, "grammar": grammar_spec(args),
            "penalties": Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty),
            "logit_bias": tuple(args.logit_bias)}
