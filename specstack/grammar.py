"""Structured output: a grammar's token masks over a draft tree, and the tokens it forces (DESIGN §5).

Terms. A *matcher* (llguidance's LLMatcher) holds the grammar's state after the tokens generated so far;
its *mask* says which tokens may come next. Under speculation the target scores a whole tree at once, so
the mask of every tree position is needed: `tree_masks` walks the tree depth first, advancing the matcher
by each node's token and rolling it back on the way up, so each node's row gets the mask of the state
after its own path (committed tokens + its ancestors + itself) and the matcher ends where it began. A
node the grammar refuses can never be accepted (its parent's row gives its token no mass), so its row
and its subtree's are left unmasked. After verification `commit` advances the matcher by the emitted
tokens. *Forced* tokens are those the grammar allows alone from the committed state, tokenized as the
tokenizer would (llguidance's `compute_ff_tokens`: a key of a schema, a closing bracket): the engine
offers them as drafts (origin `grammar`), which the target verifies like any other (SGLang's jump-forward
as speculation, so it stays lossless).

llguidance was chosen over xgrammar (docs/bench-history, "Structured output"): a dependency-free wheel
(xgrammar pulls triton and a TVM runtime), masks in microseconds on this CPU, Lark grammars with
embedded JSON schemas (a tool call's `<tool_call>{...}</tool_call>` in one grammar), rollback, and forced
tokens as tokens.
"""
from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch as llt
import torch

from specstack.config import GrammarSpec
from specstack.errors import SpecstackError
from specstack.tree import DraftTree

# JSON as one compact line (`{"a": 1, "b": [2, 3]}`, Python's json.dumps style): without a fixed
# layout a schema's keys are not forced (whitespace could come first) and the grammar forces nothing
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """A tokenizer's vocabulary as llguidance reads it (built once: seconds for a large vocabulary) and
    the grammars compiled against it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_ids) or None)

    def grammar(self, spec: GrammarSpec) -> str:
        """The spec as llguidance's grammar text; a SpecstackError names what is wrong with it."""
        try:
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "x-guidance": JSON_LAYOUT})
            if spec.kind == "json_schema":
                schema = json.loads(spec.text)
                if not isinstance(schema, dict):
                    raise SpecstackError("a JSON schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": JSON_LAYOUT})
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.text)
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        except json.JSONDecodeError as e:
            raise SpecstackError(f"the JSON schema is not valid JSON: {e}") from None
        except (ValueError, TypeError) as e:
            raise SpecstackError(f"invalid {spec.kind} grammar: {e}") from None

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A matcher at the grammar's start; a SpecstackError if the grammar does not compile."""
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(spec))
        if m.is_error():
            raise SpecstackError(f"invalid {spec.kind} grammar: {m.get_error()}")
        return Matcher(m, self.vocab_size, self.eos_ids)


_COMPILERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], GrammarCompiler]] = \
    weakref.WeakKeyDictionary()


def compiler_for(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
    """The tokenizer's compiler, built once while the tokenizer lives (every engine over one model, e.g.
    one per `generate` call, shares it)."""
    per = _COMPILERS.setdefault(tokenizer, {})
    key = (vocab_size, tuple(eos_ids))
    if key not in per:
        per[key] = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    return per[key]


class Matcher:
    """One row's grammar state, advanced by the tokens it emits."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int] = frozenset()) -> None:
        self.m = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def tree_masks(self, tree: DraftTree) -> torch.Tensor:
        """[1 + n, words] bitmask (llguidance's layout): row 0 the mask at the root, row i + 1 the mask
        after node i's path; rows of nodes the grammar refuses (and of their subtrees) allow every token.
        The matcher is back at its committed state when this returns."""
        n = len(tree)
        bits = llt.allocate_token_bitmask(1 + n, self.vocab_size)
        bits.fill_(-1)  # every token allowed
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parent):
            kids.setdefault(p, []).append(i)
        llt.fill_next_token_bitmask(self.m, bits, 0)
        stack: list[tuple[int, bool]] = [(c, False) for c in reversed(kids.get(-1, []))]
        while stack:  # depth first: (node, leaving) pairs; leaving rolls its token back
            node, leaving = stack.pop()
            if leaving:
                self.m.rollback(1)
                continue
            token = tree.tokens[node]
            # an end token ends the text: nothing after it is emitted, so it is not consumed (llguidance
            # keeps no history of it, and a rollback would undo the token before it)
            if token in self.eos_ids or not allowed(bits[tree.parent[node] + 1], token):
                continue  # refused or final: its row and subtree stay unmasked (they are never reached)
            if not self.m.consume_token(token):
                raise SpecstackError(f"grammar matcher refused an allowed token: {self.m.get_error()}")
            llt.fill_next_token_bitmask(self.m, bits, node + 1)
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(kids.get(node, [])))
        if self.m.is_error():
            raise SpecstackError(f"grammar matcher failed: {self.m.get_error()}")
        return bits

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by emitted tokens (each allowed by the mask it was chosen under)."""
        for t in tokens:
            if self.m.is_stopped() or t in self.eos_ids:  # the text ends
                return
            if not self.m.consume_token(int(t)):
                raise SpecstackError(f"grammar refused emitted token {t}: {self.m.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here, as the tokenizer would write them (may be empty)."""
        return list(self.m.compute_ff_tokens())

    @property
    def done(self) -> bool:
        return bool(self.m.is_stopped())


def allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether one row of a bitmask ([words] int32, bit t % 32 of word t // 32) allows `token`."""
    return token < 32 * mask.shape[0] and bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def apply_masks(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with the tokens a row's mask refuses set to -inf (a new tensor)."""
    rows, vocab = logits.shape
    # unpacked here rather than by llguidance.torch's helper, which torch.compiles itself on first use
    # (seconds, and a C compiler) for a step that takes a fraction of a millisecond
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allow = ((bits.to(logits.device)[:, :, None] >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
    return logits.float().masked_fill(~allow, float("-inf"))
