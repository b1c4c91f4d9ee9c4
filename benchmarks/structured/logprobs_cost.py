"""What log-probabilities cost (issue 35's goal: <= 3 % of decoding time), measured two ways in one run:

1. interleaved decodes of the same prompts with and without `logprobs` (top 5), `--repeats` times each,
   A and B alternating so the machine's drift falls on both; the median decode time per prompt;
2. the extra work alone: `processing.token_logprobs` over R rows of the vocabulary (R = 1: a plain decode
   step; R = 4: an accepted path of 3 plus its bonus token), against the median decode step of (1).

    python benchmarks/structured/logprobs_cost.py [--model qwen2.5-coder-1.5b] [--dtype int4] [--method ar]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specstack.config import GenerationConfig
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
from specstack.machine import cpu_model
from specstack.models.loading import load_model
from specstack.processing import token_logprobs
from specstack.prompts import encode_prompt

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash map is in two sentences.",
           "def fibonacci(n):"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, dtype=args.dtype)
    spec = parse_method(args.method)

    def decode(ids: list[int], logprobs: int | None) -> tuple[float, int]:
        drafter = build_drafter(spec, lm, DraftSources.for_model(args.model))
        out = generate(lm, ids, GenerationConfig(max_new_tokens=args.tokens, stop_on_eos=False, logprobs=logprobs),
                       drafter=drafter, length=length_rule(spec, lm) if drafter is not None else None)
        return out.stats.decode_seconds, len(out.tokens)

    ids = [encode_prompt(lm.tokenizer, p, chat=True) for p in PROMPTS]
    decode(ids[0], 5)  # warm-up
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.repeats):
        for k, prompt in enumerate(ids):
            for name, lp in (("off", None), ("on", 5)) if (r + k) % 2 == 0 else (("on", 5), ("off", None)):
                seconds, n = decode(prompt, lp)
                times[name].append(seconds / n)
                print(f"repeat {r} prompt {k} logprobs {name}: {n / seconds:.2f} tok/s", file=sys.stderr, flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"machine: {cpu_model()}; {args.model} ({args.dtype}), method {args.method}, {args.tokens} tokens x "
          f"{len(PROMPTS)} prompts x {args.repeats} repeats, interleaved")
    print(f"decode s/token: without logprobs {off * 1000:.1f} ms, with top-5 logprobs {on * 1000:.1f} ms "
          f"({on / off - 1:+.1%})")
    vocab = lm.config.vocab_size
    for rows in (1, 4):
        logits = torch.randn(rows, vocab)
        token_logprobs(logits, list(range(rows)), 5)
        t0 = time.perf_counter()
        for _ in range(50):
            token_logprobs(logits, list(range(rows)), 5)
        per = (time.perf_counter() - t0) / 50
        print(f"token_logprobs over {rows} x {vocab}: {per * 1000:.2f} ms = {per / off:.1%} of a decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
