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
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

VOCAB = 151_936  # Qwen2.5-Coder's logits width (the tokenizer pads its table to it)
K_ROLLBACK = 4
APPLY_REPS = 200
SEP = (", ", ": ")  # json.dumps' default separators; both engines are told to emit exactly these


# ---------------------------------------------------------------------------------------------------
# Grammars and their documents
# ---------------------------------------------------------------------------------------------------
def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string", "pattern": r"^[a-z0-9._]+@[a-z0-9]+\.[a-z]{2,4}$"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": _obj({"street": {"type": "string"}, "city": {"type": "string"},
                         "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}}),
        "tags": {"type": "array", "items": {"type": "string"}},
    }),
    "order": _obj({
        "order_id": {"type": "string", "pattern": r"^ORD-[0-9]{8}$"},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "items": {"type": "array", "minItems": 1, "items": _obj({
            "sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 1000},
            "price": {"type": "number"},
            "gift": {"type": "boolean"},
        })},
    }),
    "tool_call": _obj({
        "name": {"enum": ["search_code", "read_file", "run_tests"]},
        "arguments": _obj({
            "query": {"type": "string"},
            "paths": {"type": "array", "items": {"type": "string"}},
            "max_results": {"type": "integer", "minimum": 1},
            "case_sensitive": {"type": "boolean"},
        }),
    }),
    "event": _obj({
        "title": {"type": "string"},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "start": {"type": "string", "pattern": r"^[0-2][0-9]:[0-5][0-9]$"},
        "location": {"type": ["string", "null"]},
        "attendees": {"type": "array", "items": _obj({
            "name": {"type": "string"},
            "status": {"enum": ["accepted", "declined", "tentative"]},
        })},
    }),
    "matrix": _obj({
        "label": {"enum": ["weights", "bias", "scale"]},
        "rows": {"type": "integer"},
        "cols": {"type": "integer"},
        "data": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    }),
    "config": _obj({
        "version": {"enum": ["1.0", "1.1", "2.0"]},
        "server": _obj({
            "host": {"type": "string"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "tls": _obj({"enabled": {"type": "boolean"}, "cert": {"type": "string"}}),
        }),
        "limits": _obj({"rps": {"type": "number"}, "burst": {"type": "integer"}}),
        "features": {"type": "array", "items": {"enum": ["cache", "metrics", "tracing", "auth"]}},
    }),
}


def _doc(name: str, n: int) -> dict[str, Any]:
    """A valid instance of SCHEMAS[name] whose arrays hold `n`-ish items (the knob for its length)."""
    if name == "person":
        return {"id": 4217, "name": "Ada Lovelace", "email": "ada.l@example.org", "active": True, "role": "editor",
                "address": {"street": "12 St James's Square", "city": "London", "zip": "02139"},
                "tags": [f"tag{i}" for i in range(n)]}
    if name == "order":
        return {"order_id": "ORD-20240517", "currency": "EUR",
                "items": [{"sku": f"ABC-{1000 + i}", "qty": i + 1, "price": 9.99 + i, "gift": i % 2 == 0}
                          for i in range(max(n, 1))]}
    if name == "tool_call":
        return {"name": "search_code", "arguments": {"query": "def apply_token_bitmask",
                                                     "paths": [f"src/pkg{i}/module.py" for i in range(n)],
                                                     "max_results": 20, "case_sensitive": False}}
    if name == "event":
        return {"title": "Design review", "date": "2024-05-17", "start": "14:30", "location": None,
                "attendees": [{"name": f"person {i}", "status": ["accepted", "declined", "tentative"][i % 3]}
                              for i in range(n)]}
    if name == "matrix":
        rows = max(n, 1)
        return {"label": "weights", "rows": rows, "cols": 4,
                "data": [[0.25 * (r % 3), -1.5 + r, 3.0, r * 0.125] for r in range(rows)]}
    if name == "config":
        feats = ["cache", "metrics", "tracing", "auth"]
        return {"version": "1.1", "server": {"host": "localhost", "port": 8080,
                                             "tls": {"enabled": True, "cert": "/etc/ssl/server.pem"}},
                "limits": {"rps": 250.5, "burst": 40}, "features": [feats[i % 4] for i in range(n)]}
    raise KeyError(name)


@dataclass
class Case:
    name: str
    kind: str  # "json_schema" | "regex" | "lark"
    source: Any  # schema dict, regex string, or lark text
    text: str  # a valid document


LARK_PREFIX = "Result: "


def build_cases(tok: Any, n_schemas: int, target_tokens: int) -> list[Case]:
    def sized(name: str) -> str:
        text = ""
        for n in range(0, 65):
            text = json.dumps(_doc(name, n), separators=SEP)
            if len(tok.encode(text, add_special_tokens=False)) >= target_tokens:
                break
        return text

    names = list(SCHEMAS)[:n_schemas]
    cases = [Case(n, "json_schema", SCHEMAS[n], sized(n)) for n in names]
    person = sized("person")
    cases.append(Case("json_object", "json_schema", {"type": "object"}, person))
    # \d is Unicode-aware in llguidance (Rust regex: full-width and other digits pass) and ASCII in
    # xgrammar; kept as written to show it, [0-9] is what a grammar should say.
    cases.append(Case("regex_date", "regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"))
    # %json{...} takes a JSON schema inline; "x-guidance" carries the compile options a JSON grammar
    # gets from overrides= elsewhere (the lark text has nowhere else to put them).
    embedded = dict(SCHEMAS["person"], **{"x-guidance": {"whitespace_flexible": False,
                                                          "item_separator": SEP[0], "key_separator": SEP[1]}})
    lark = f'start: "{LARK_PREFIX}" obj "\\n"\nobj: %json{json.dumps(embedded)}\n'
    cases.append(Case("lark_json", "lark", lark, LARK_PREFIX + person + "\n"))
    return cases


# ---------------------------------------------------------------------------------------------------
# The engines, behind one small interface
# ---------------------------------------------------------------------------------------------------
class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor) -> None: ...
    def accept(self, token: int) -> bool: ...
    def accept_many(self, tokens: list[int]) -> bool: ...
    def rollback(self, k: int) -> None: ...
    def forced_tokens(self) -> list[int]: ...
    def forced_bytes(self) -> bytes: ...
    def reset(self) -> None: ...
    def error(self) -> str | None: ...


class Engine(Protocol):
    name: str
    def compile(self, case: Case) -> Matcher: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class XGrammarMatcher:
    def __init__(self, m: Any) -> None:
        self.m = m

    def fill(self, bitmask: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def accept_many(self, tokens: list[int]) -> bool:
        return all(self.m.accept_token(t) for t in tokens)

    def rollback(self, k: int) -> None:
        self.m.rollback(k)

    def forced_tokens(self) -> list[int]:
        return list(self.m.find_jump_forward_tokens())

    def forced_bytes(self) -> bytes:
        return self.m.find_jump_forward_string().encode()

    def reset(self) -> None:
        self.m.reset()

    def error(self) -> str | None:
        return None  # xgrammar reports a rejected token by accept_token returning False


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tok: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.tokenizer_ms = (time.perf_counter() - t0) * 1e3
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.version = _dist_version("xgrammar")
        self.memory: dict[str, int] = {}

    def compile(self, case: Case) -> Matcher:
        c = self.compiler
        if case.kind == "json_schema":
            g = c.compile_json_schema(json.dumps(case.source), any_whitespace=False, separators=SEP)
        elif case.kind == "regex":
            g = c.compile_regex(case.source)
        else:
            g = c.compile_lark(case.source)
        self.memory[case.name] = g.memory_size_bytes
        return XGrammarMatcher(self.xgr.GrammarMatcher(g))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)  # backend "auto" is "cpu" for CPU tensors


class LLGuidanceMatcher:
    def __init__(self, m: Any) -> None:
        import llguidance.torch as llt

        self.m = m
        self.llt = llt

    def fill(self, bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask(self.m, bitmask, 0)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    def accept_many(self, tokens: list[int]) -> bool:
        return bool(self.m.consume_tokens(tokens))

    def rollback(self, k: int) -> None:
        if not self.m.rollback(k):
            raise RuntimeError(f"rollback({k}) refused: {self.m.get_error()}")

    def forced_tokens(self) -> list[int]:
        return list(self.m.compute_ff_tokens())

    def forced_bytes(self) -> bytes:
        return bytes(self.m.compute_ff_bytes())

    def reset(self) -> None:
        self.m.reset()

    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.tokenizer_ms = (time.perf_counter() - t0) * 1e3
        self.version = _dist_version("llguidance")
        self.options: Any = {"whitespace_flexible": False, "item_separator": SEP[0], "key_separator": SEP[1]}

    def compile(self, case: Case) -> Matcher:
        M = self.llg.LLMatcher
        if case.kind == "json_schema":
            grammar = M.grammar_from_json_schema(case.source, overrides=self.options)
        elif case.kind == "regex":
            grammar = M.grammar_from_regex(case.source)
        else:
            grammar = M.grammar_from_lark(case.source)
        m = M(self.tokenizer, grammar, log_level=1)
        if m.is_error():  # the constructor never raises for a bad grammar; it leaves the matcher in error
            raise RuntimeError(m.get_error())
        return LLGuidanceMatcher(m)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd: the first call compiles


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------
def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return (int(bitmask[0, token >> 5]) >> (token & 31)) & 1 == 1


def _us(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"median": round(float(np.median(a)), 2), "p90": round(float(np.percentile(a, 90)), 2), "n": len(ns)}


@dataclass
class CaseResult:
    engine: str
    grammar: str
    tokens: int
    compile_ms: float = float("nan")
    first_mask_us: float = float("nan")
    mask_us: dict[str, float] = field(default_factory=dict)  # cold walk, first mask excluded
    mask_warm_us: dict[str, float] = field(default_factory=dict)  # same grammar after reset()
    allowed_mean: float = float("nan")  # tokens the mask allows, averaged over positions
    accept_us: dict[str, float] = field(default_factory=dict)
    forced_us: dict[str, float] = field(default_factory=dict)
    forced_positions: int = 0  # positions where the engine found a non-empty forced continuation
    forced_tokens_matching: int = 0  # document tokens covered by forced tokens equal to the document's
    forced_bytes_covered: int = 0  # document bytes covered by a forced byte string
    doc_bytes: int = 0
    rollback_us: dict[str, float] = field(default_factory=dict)
    readvance_us: dict[str, float] = field(default_factory=dict)  # accepting the K tokens again
    eos_allowed_at_end: bool = False
    error: str | None = None


def measure_case(engine: Engine, case: Case, tokens: list[int], pieces: list[bytes], eos: int) -> CaseResult:
    r = CaseResult(engine.name, case.name, len(tokens), doc_bytes=sum(map(len, pieces)))
    try:
        t0 = time.perf_counter_ns()
        m = engine.compile(case)
        r.compile_ms = round((time.perf_counter_ns() - t0) / 1e6, 2)
    except Exception as e:  # an unsupported grammar is a result, not a crash
        r.error = f"compile: {type(e).__name__}: {e}"[:300]
        return r

    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(int)
    doc = b"".join(pieces)
    covered_tok = np.zeros(len(tokens), dtype=bool)
    covered_byte = np.zeros(len(doc), dtype=bool)
    masks: list[int] = []
    accepts: list[int] = []
    forced: list[int] = []
    allowed: list[int] = []
    for i, t in enumerate(tokens):
        t0 = time.perf_counter_ns()
        m.fill(bitmask)
        masks.append(time.perf_counter_ns() - t0)
        allowed.append(int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum()))
        if not _allowed(bitmask, t):
            r.error = f"token {i} ({pieces[i]!r}) masked out; {m.error() or ''}"[:300]
            break
        t0 = time.perf_counter_ns()
        ff = m.forced_tokens()
        forced.append(time.perf_counter_ns() - t0)
        fb = m.forced_bytes()
        if ff or fb:
            r.forced_positions += 1
        if ff and tokens[i:i + len(ff)] == ff:
            covered_tok[i:i + len(ff)] = True
        if fb and doc[offsets[i]:].startswith(fb):
            covered_byte[offsets[i]:offsets[i] + len(fb)] = True
        t0 = time.perf_counter_ns()
        ok = m.accept(t)
        accepts.append(time.perf_counter_ns() - t0)
        if not ok:
            r.error = f"accept token {i} ({pieces[i]!r}) refused; {m.error() or ''}"[:300]
            break
    else:
        m.fill(bitmask)
        r.eos_allowed_at_end = _allowed(bitmask, eos)
    r.first_mask_us = round(masks[0] / 1e3, 2) if masks else float("nan")
    r.mask_us = _us(masks[1:])
    r.accept_us = _us(accepts)
    r.forced_us = _us(forced)
    r.allowed_mean = round(statistics.fmean(allowed), 1) if allowed else float("nan")
    r.forced_tokens_matching = int(covered_tok.sum())
    r.forced_bytes_covered = int(covered_byte.sum())
    if r.error:
        return r

    # Warm walk: same matcher after reset() (llguidance keeps its lazily built lexer states).
    m.reset()
    warm: list[int] = []
    for t in tokens:
        t0 = time.perf_counter_ns()
        m.fill(bitmask)
        warm.append(time.perf_counter_ns() - t0)
        m.accept(t)
    r.mask_warm_us = _us(warm[1:])

    # Rollback walk: after each token from the K-th on, roll back K and accept the same K again.
    m.reset()
    rb: list[int] = []
    ra: list[int] = []
    try:
        for i, t in enumerate(tokens):
            if not m.accept(t):
                raise RuntimeError(f"accept {i} refused in the rollback walk; {m.error() or ''}")
            if i + 1 >= K_ROLLBACK:
                t0 = time.perf_counter_ns()
                m.rollback(K_ROLLBACK)
                t1 = time.perf_counter_ns()
                ok = m.accept_many(tokens[i + 1 - K_ROLLBACK:i + 1])
                t2 = time.perf_counter_ns()
                if not ok:
                    raise RuntimeError(f"re-advance at {i} refused; {m.error() or ''}")
                rb.append(t1 - t0)
                ra.append(t2 - t1)
    except Exception as e:
        r.error = f"rollback: {type(e).__name__}: {e}"[:300]
    r.rollback_us = _us(rb)
    r.readvance_us = _us(ra)
    return r


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_torch_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Engine-independent reference: unpack the bits with a broadcast shift, then one masked_fill_."""
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).flatten(1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class TorchEager:
    name = "torch_eager"
    apply = staticmethod(apply_torch_eager)


def measure_apply(engine: Any, bitmask: torch.Tensor) -> dict[str, float]:
    base = torch.randn(1, VOCAB, dtype=torch.float32)
    logits = base.clone()
    t0 = time.perf_counter_ns()
    engine.apply(logits, bitmask)  # first call: llguidance's helper is torch.compile'd here
    first = time.perf_counter_ns() - t0
    ns: list[int] = []
    for _ in range(APPLY_REPS):
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        engine.apply(logits, bitmask)
        ns.append(time.perf_counter_ns() - t0)
    want = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB].astype(bool))
    correct = bool(torch.equal(torch.isinf(logits[0]), ~want))
    return {"first_ms": round(first / 1e6, 2), **_us(ns), "correct": correct}


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------
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
