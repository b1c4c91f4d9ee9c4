"""Structured output under speculation, measured (issue 35's goals), one process, one model load:

- JSON-schema output with speculation against our own `ar` with the same schema (goal >= 1.5 x), and
  against free text with speculation, the same prompts without the schema (goal >= 1.3 x), in tokens
  per second of decoding (prefill excluded: the prompts are the same in every run);
- every schema-constrained output valid for its schema (jsonschema);
- the cost of log-probabilities (top 5) against the same runs without them (goal <= 3 %).

The schemas (schemas.json) are a held-out set written for this benchmark: nested objects, enums, arrays,
numbers and booleans; the prompts ask for the record in words. Greedy decoding, so every run of a prompt
emits the same tokens whatever the method (checked: a divergence is reported). Rows go to OUT/rows.jsonl,
the summary to stdout as a markdown table.

    python benchmarks/structured/json_bench.py --model qwen2.5-coder-1.5b --out OUT [--dtype int4] [--draft-method chain:k=4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

from specstack.config import GenerationConfig, GrammarSpec
from specstack.engine.batched import generate
from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
from specstack.machine import cpu_model
from specstack.models.loading import load_model
from specstack.processing import RowProcessor
from specstack.prompts import encode_prompt

HERE = Path(__file__).parent
ruled = RowProcessor.along


def blind_rule(self, logits, paths, ids=None):
    return logits.float()


def prompt_for(task: str) -> str:
    return f"Write one JSON object describing {task}. Answer with the JSON only."


def run(lm, ids, gen, method: str, model: str):
    spec = parse_method(method)
    drafter = build_drafter(spec, lm, DraftSources.for_model(model))
    t0 = time.perf_counter()
    out = generate(lm, ids, gen, drafter=drafter, length=length_rule(spec, lm) if drafter is not None else None)
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--method", default="auto", help="the speculative method (default: the model's auto)")
    ap.add_argument("--draft-method", default="",
                    help="also a draft-model method (e.g. chain:k=4) with the schema, its draft's own rows masked "
                         "(as shipped) and unmasked (the control: the drafter blind to the grammar)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--schemas", type=Path, default=HERE / "schemas.json")
    ap.add_argument("--limit", type=int, default=0, help="the first N schemas only (0: all)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = json.loads(args.schemas.read_text(encoding="utf-8"))
    cases = cases[: args.limit] if args.limit else cases
    lm = load_model(args.model, dtype=args.dtype)
    configs = {  # name -> (method, grammar?, logprobs)
        "ar+schema": ("ar", True, None),
        "spec+schema": (args.method, True, None),
        "spec free": (args.method, False, None),
        "ar free": ("ar", False, None),
        "ar free+logprobs": ("ar", False, 5),
        "spec+schema+logprobs": (args.method, True, 5),
    }
    if args.draft_method:
        configs["draft+schema"] = (args.draft_method, True, None)
        configs["draft+schema, draft blind"] = (args.draft_method, True, None)
    warm = encode_prompt(lm.tokenizer, prompt_for(cases[0]["task"]), chat=True)
    run(lm, warm, GenerationConfig(max_new_tokens=8, grammar=GrammarSpec("json_object")), args.method, args.model)
    rows = []
    with (args.out / "rows.jsonl").open("w", encoding="utf-8") as f:
        for k, case in enumerate(cases):
            ids = encode_prompt(lm.tokenizer, prompt_for(case["task"]), chat=True)
            grammar = GrammarSpec("json_schema", json.dumps(case["schema"]))
            for name, (method, constrained, logprobs) in configs.items():
                gen = GenerationConfig(max_new_tokens=args.max_new_tokens, grammar=grammar if constrained else None,
                                       logprobs=logprobs)
                blind = name.endswith("draft blind")
                if blind:  # the control: the draft's rows get no rule (verification still applies it)
                    RowProcessor.along = blind_rule  # type: ignore[method-assign]
                try:
                    out, wall = run(lm, ids, gen, method, args.model)
                finally:
                    RowProcessor.along = ruled  # type: ignore[method-assign]
                valid = None
                if constrained:
                    try:
                        jsonschema.validate(json.loads(out.text), case["schema"])
                        valid = True
                    except (ValueError, jsonschema.ValidationError):
                        valid = False
                st = out.stats
                row = {"case": k, "config": name, "method": method, "tokens": len(out.tokens), "wall_s": wall,
                       "decode_s": st.decode_seconds, "prefill_s": st.prefill_seconds,
                       "tok_per_s": len(out.tokens) / max(st.decode_seconds, 1e-9), "forwards": st.target_forwards,
                       "origins": {o: out.origins.count(o) for o in sorted(set(out.origins))}, "valid": valid,
                       "finish": out.finish_reason, "text": out.text}
                rows.append(row)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                print(f"[{k + 1}/{len(cases)}] {name:22s} {row['tokens']:4d} tokens {row['tok_per_s']:6.2f} tok/s "
                      f"valid={valid} {row['origins']}", file=sys.stderr, flush=True)
    summary(rows, configs, args)
    return 0


def summary(rows: list[dict], configs: dict, args: argparse.Namespace) -> None:
    def rate(name: str) -> float:  # tokens over decode seconds, all cases pooled
        rs = [r for r in rows if r["config"] == name]
        return sum(r["tokens"] for r in rs) / sum(r["decode_s"] for r in rs)

    print(f"machine: {cpu_model()}\nmodel {args.model} ({args.dtype}), method {args.method}, "
          f"{len({r['case'] for r in rows})} schemas, greedy\n")
    print("| run | tokens | decode tok/s | tokens/forward | by origin | valid |\n|---|---|---|---|---|---|")
    for name in configs:
        rs = [r for r in rows if r["config"] == name]
        origins: dict[str, int] = {}
        for r in rs:
            for o, n in r["origins"].items():
                origins[o] = origins.get(o, 0) + n
        valid = "" if rs[0]["valid"] is None else f"{sum(r['valid'] for r in rs)}/{len(rs)}"
        tau = sum(r["tokens"] for r in rs) / max(1, sum(r["forwards"] for r in rs))
        print(f"| {name} | {sum(r['tokens'] for r in rs)} | {rate(name):.2f} | {tau:.2f} | {origins} | {valid} |")
    same = all(r["text"] == s["text"] for r in rows for s in rows if r["case"] == s["case"]
               and ("schema" in r["config"]) == ("schema" in s["config"])
               and ("free" in r["config"]) == ("free" in s["config"]))
    print(f"\nspec+schema / ar+schema: {rate('spec+schema') / rate('ar+schema'):.2f} x (goal 1.5)")
    print(f"spec+schema / spec free: {rate('spec+schema') / rate('spec free'):.2f} x (goal 1.3)")
    print(f"logprobs cost, ar: {1 - rate('ar free+logprobs') / rate('ar free'):+.1%}; with speculation and a schema: "
          f"{1 - rate('spec+schema+logprobs') / rate('spec+schema'):+.1%} (goal <= 3 %)")
    print(f"every method's text the same per case and mode: {same}")
    if "draft+schema" in configs:
        print(f"draft+schema / ar+schema: {rate('draft+schema') / rate('ar+schema'):.2f} x; the draft's rows masked "
              f"against blind: {rate('draft+schema') / rate('draft+schema, draft blind'):.2f} x")
    per = [r["tok_per_s"] for r in rows if r["config"] == "spec+schema"]
    print(f"spec+schema per-case tok/s: median {statistics.median(per):.2f}")


if __name__ == "__main__":
    sys.exit(main())
