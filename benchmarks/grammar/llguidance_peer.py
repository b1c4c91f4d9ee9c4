"""llguidance behind engine_api's interface (not a specstack dependency: installed in a separate venv, see
benchmarks/grammar/engines.py)."""
from __future__ import annotations

import time
from typing import Any

import torch
from engine_api import VOCAB, Matcher, dist_version
from grammar_cases import SEP, Case


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
        self.version = dist_version("llguidance")
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
