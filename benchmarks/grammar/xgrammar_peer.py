"""xgrammar behind engine_api's interface (not a specstack dependency: installed in a separate venv, see
benchmarks/grammar/engines.py)."""
from __future__ import annotations

import json
import time
from typing import Any

import torch
from engine_api import VOCAB, Matcher, dist_version
from grammar_cases import SEP, Case


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
        self.version = dist_version("xgrammar")
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
