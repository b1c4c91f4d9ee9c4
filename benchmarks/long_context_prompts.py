"""Long-context code prompts for SPIRe's regime (issue: BASS, item 6): each prompt is a run of HumanEval
problem prompts (signatures and docstrings only, never a solution) followed by one problem's prompt, cut
to about TOKENS tokens of the default model's tokenizer, so a batch's KV cache, not its weights, is what
a step mostly reads. Writes a JSONL prompt set for `specstack bench --prompts FILE`.

    python benchmarks/long_context_prompts.py --tokens 1024 --count 32 --out bench_out/long1024.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specstack.bench.datasets import iter_humaneval
from specstack.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="about this many prompt tokens each")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tok = load_model("smollm2-135m").tokenizer
    problems = list(iter_humaneval())
    rows = []
    for i in range(args.count):
        last = problems[i]
        # the problems before it, cyclically, until the context is full; then the problem itself
        before: list[str] = []
        j = i - 1
        while len(tok.encode("\n\n".join([*before, last.text]))) < args.tokens:
            before.insert(0, problems[j % len(problems)].text.rstrip() + "\n    ...\n")
            j -= 1
        text = "\n\n".join([*before, last.text])
        ids = tok.encode(text)
        if len(ids) > args.tokens:  # cut from the front: the problem to complete stays whole
            text = tok.decode(ids[len(ids) - args.tokens:])
        rows.append({"task_id": f"long{args.tokens}/{last.task_id}", "prompt": text})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts of about {args.tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
