"""Grammar engines for constrained decoding, measured on this CPU with Qwen2.5-Coder's tokenizer.

Compares xgrammar and llguidance (both from PyPI; neither is a specstack dependency) on the work a
constrained speculative decoder does per token, with the 151,936-entry Qwen2.5-Coder vocabulary:

1. building each engine's tokenizer info from the Hugging Face tokenizer (timed once);
2. compiling JSON schemas (nested objects, enums, arrays, patterned strings, numbers, booleans),
   an any-JSON-object grammar, an ISO-date regex, and a Lark grammar embedding ``%json{...}``
   (time per grammar, matcher construction included);
3. walking a valid document for each grammar token by token (the document as the tokenizer encodes
   it, no special tokens): at each position, the time to fill the next-token bitmask (the first mask
   apart, then median and p90, on a fresh matcher and again after ``reset()``), the time to find
   forced tokens (llguidance ``compute_ff_tokens``, xgrammar ``find_jump_forward_tokens`` /
   ``find_jump_forward_string``) and how much of the document they cover, the time to accept the
   token; then, on a second walk, the cost of rolling back k tokens and accepting them again;
4. applying a bitmask to fp32 logits of shape [1, 151936] with each engine's helper.

Every document token is checked against the mask before it is accepted, and EOS must be allowed at
the end, so a number is only reported for a walk the engine agreed with.

    python -m venv --system-site-packages /tmp/gbench
    /tmp/gbench/bin/pip install xgrammar==0.2.9 llguidance==1.9.1
    /tmp/gbench/bin/python benchmarks/grammar/engines.py --schemas 6 --tokens 128 --out /tmp/engines.json

This file is the entry point and the table; beside it: grammar_cases.py (the grammars and their documents),
engine_api.py (the interface each engine is measured through), xgrammar_peer.py and llguidance_peer.py (one
engine each) and measure_engines.py (the walk and the apply timings).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from engine_api import VOCAB
from grammar_cases import SCHEMAS, SEP, Case, build_cases
from llguidance_peer import LLGuidanceEngine
from measure_engines import K_ROLLBACK, CaseResult, TorchEager, measure_apply, measure_case
from xgrammar_peer import XGrammarEngine


def load_qwen_tokenizer() -> Any:
    from specstack.models.loading import load_tokenizer, model_cache_dir
    from specstack.models.registry import resolve

    src = resolve("qwen2.5-coder-1.5b")
    return load_tokenizer(src, model_cache_dir(src))


def _table(results: list[CaseResult], engines: dict[str, dict[str, Any]]) -> str:
    lines = ["| engine | grammar | tok | compile ms | 1st mask us | mask us med/p90 | warm med/p90 | "
             "allowed | accept us | rollback4 us | re-adv4 us | ff us | ff pos | ff tok/bytes | eos | error |",
             "|" + "---|" * 16]
    for r in results:
        ff = f"{r.forced_tokens_matching}/{r.tokens} t, {r.forced_bytes_covered}/{r.doc_bytes} B"
        lines.append(
            f"| {r.engine} | {r.grammar} | {r.tokens} | {r.compile_ms} | {r.first_mask_us} | "
            f"{r.mask_us.get('median')}/{r.mask_us.get('p90')} | {r.mask_warm_us.get('median')}/"
            f"{r.mask_warm_us.get('p90')} | {r.allowed_mean} | {r.accept_us.get('median')} | "
            f"{r.rollback_us.get('median')} | {r.readvance_us.get('median')} | {r.forced_us.get('median')} | "
            f"{r.forced_positions} | {ff} | {'y' if r.eos_allowed_at_end else 'n'} | {r.error or ''} |")
    lines += ["", "| engine | version | tokenizer info ms | first compile ms | apply first ms | apply us med/p90 | apply correct |",
              "|---|---|---|---|---|---|---|"]
    for name, e in engines.items():
        a = e.get("apply", {})
        lines.append(f"| {name} | {e['version']} | {e['tokenizer_ms']} | {e.get('first_compile_ms', '-')} | "
                     f"{a.get('first_ms')} | "
                     f"{a.get('median')}/{a.get('p90')} | {a.get('correct')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS), help=f"JSON schemas to use (1-{len(SCHEMAS)})")
    ap.add_argument("--tokens", type=int, default=128, help="grow each JSON document to at least this many tokens")
    ap.add_argument("--engines", default="xgrammar,llguidance", help="comma-separated: xgrammar, llguidance")
    ap.add_argument("--threads", type=int, default=2, help="xgrammar compiler threads")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for the apply timings (1: steady on a shared 2-core machine)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)

    t0 = time.perf_counter()
    tok = load_qwen_tokenizer()
    print(f"tokenizer: {type(tok).__name__}, {len(tok)} entries, loaded in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    cases = build_cases(tok, max(1, min(args.schemas, len(SCHEMAS))), args.tokens)
    eos = int(tok.eos_token_id)

    results: list[CaseResult] = []
    engines: dict[str, dict[str, Any]] = {}
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        engine: Any = XGrammarEngine(tok, args.threads) if name == "xgrammar" else LLGuidanceEngine(tok)
        info: dict[str, Any] = {"version": engine.version, "tokenizer_ms": round(engine.tokenizer_ms, 1)}
        # The first compile pays one-time set-up; time it apart on a grammar no case uses.
        t0 = time.perf_counter()
        engine.compile(Case("warmup", "regex", "[a-z]+", "abc"))
        info["first_compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        mid_mask: torch.Tensor | None = None
        for case in cases:
            tokens = tok.encode(case.text, add_special_tokens=False)
            pieces = [tok.decode([t]).encode() for t in tokens]  # the documents are ASCII
            assert b"".join(pieces) == case.text.encode(), case.name
            r = measure_case(engine, case, tokens, pieces, eos)
            results.append(r)
            print(f"{name} {case.name}: compile {r.compile_ms} ms, mask {r.mask_us.get('median')} us"
                  f"{', ERROR ' + r.error if r.error else ''}", file=sys.stderr)
            if mid_mask is None and not r.error:  # a realistic mask for the apply timing: person, mid-document
                m = engine.compile(case)
                m.accept_many(tokens[: len(tokens) // 2])
                mid_mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
                m.fill(mid_mask)
        if mid_mask is not None:
            try:
                info["apply"] = measure_apply(engine, mid_mask)
            except Exception as e:
                info["apply"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if isinstance(engine, XGrammarEngine):
            info["compiled_bytes"] = engine.memory
        engines[name] = info
    if mid_mask is not None:
        engines["torch_eager"] = {"version": torch.__version__, "tokenizer_ms": "-",
                                  "apply": measure_apply(TorchEager(), mid_mask)}

    print(_table(results, engines))
    if args.out:
        payload = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads(), "vocab": VOCAB, "k_rollback": K_ROLLBACK,
                   "separators": SEP, "engines": engines, "results": [asdict(r) for r in results],
                   "documents": {c.name: c.text for c in cases}}
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
