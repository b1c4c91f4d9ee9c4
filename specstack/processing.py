"""What a request asks of the target's logits before the warp (penalties, a bias, a grammar) applied
per tree position, and the log-probabilities it asks to see (DESIGN §5).

Terms. A verified block's logits are [1 + n, V]: row 0 at the root, row i + 1 after tree node i. A
plain decode at row r's position would see the committed tokens and then the path to r (its ancestors
and itself), so every rule is applied to row r from exactly those tokens: penalties count the
generated tokens (OpenAI) plus the path's, a repetition penalty also sees the prompt (vLLM), a grammar's
mask is its state after the path (grammar.py). Verification then runs on the processed rows as on raw
ones, so the emitted tokens are distributed as the processed target's. A model drafter applies the same
rules to its own rows (`RowProcessor.along`, the draft context's rule), so its q is the processed
draft's: recursive rejection sampling is exact for any q, but a q that proposes what the grammar refuses
only wastes verified tokens.

Order, as in vLLM: penalties, then the bias, then the grammar's mask (a refused token stays refused).
Log-probabilities are of the raw logits (before any of these and before the warp), as OpenAI reports
them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstack.config import GenerationConfig
from specstack.grammar import GrammarCompiler, Matcher, apply_masks
from specstack.tree import DraftTree


def trie(paths: Sequence[Sequence[int]]) -> tuple[DraftTree, list[int]]:
    """The paths (token sequences after the root) as one tree, and each path's row in a block's layout
    (0: the empty path, the root's row; i + 1: node i)."""
    tree, rows = DraftTree(), []
    node: dict[tuple[int, ...], int] = {(): -1}
    for path in paths:
        key: tuple[int, ...] = ()
        for t in path:
            child = (*key, int(t))
            if child not in node:
                tree.add(int(t), node[key], "draft")
                node[child] = len(tree) - 1
            key = child
        rows.append(node[key] + 1)
    return tree, rows


def path_tokens(tree: DraftTree) -> list[list[int]]:
    """Tokens on the path to each row: [] for the root's row, then each node's ancestors and itself."""
    paths: list[list[int]] = [[]]
    for i, p in enumerate(tree.parent):
        paths.append(paths[p + 1] + [tree.tokens[i]])
    return paths


class RowProcessor:
    """One row's logits rules: applied to a block's rows along their paths, advanced by what it emits."""

    def __init__(self, gen: GenerationConfig, prompt: Sequence[int], vocab_size: int,
                 grammars: GrammarCompiler | None = None) -> None:
        self.penalties = gen.penalties
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size)  # occurrences of each token among the generated ones
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # in the prompt or generated
        if prompt:
            self.seen[torch.tensor([t for t in prompt if t < vocab_size], dtype=torch.long)] = True
        self.bias: torch.Tensor | None = None
        if gen.logit_bias:
            self.bias = torch.zeros(vocab_size)
            for token, b in gen.logit_bias:
                if token < vocab_size:
                    self.bias[token] += b
        self.matcher: Matcher | None = None
        if gen.grammar is not None:
            if grammars is None:
                raise ValueError("a grammar needs the engine's GrammarCompiler")
            self.matcher = grammars.matcher(gen.grammar)

    def process(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """logits [1 + n, V] of a verified block -> the processed logits (fp32, a new tensor)."""
        masks = self.matcher.tree_masks(tree) if self.matcher is not None else None
        return self._apply(logits.float().clone(), path_tokens(tree), masks, None)

    def along(self, logits: torch.Tensor, paths: Sequence[Sequence[int]],
              ids: torch.Tensor | None = None) -> torch.Tensor:
        """A draft's logits [R, V'] (row r follows `paths[r]` from the committed tokens; column j scores
        token ids[j], or token j) -> the same rules applied (drafting/base.py's LogitsRule). Columns of no
        token of the target's vocabulary are refused."""
        out = logits.float().clone()
        cols = None  # column j is token j of the target's vocabulary
        if ids is not None or out.shape[-1] != self.vocab_size:
            cols = ids.to(out.device) if ids is not None else torch.arange(out.shape[-1], device=out.device)
            outside = cols >= self.vocab_size
            if bool(outside.any()):
                out[:, outside] = float("-inf")
                cols = cols.clamp(max=self.vocab_size - 1)
        masks = None
        if self.matcher is not None:
            tree, rows = trie(paths)
            masks = self.matcher.tree_masks(tree)[rows]
        return self._apply(out, [list(p) for p in paths], masks, cols)

    def _apply(self, out: torch.Tensor, paths: list[list[int]], masks: torch.Tensor | None,
               cols: torch.Tensor | None) -> torch.Tensor:
        """Penalties, bias, mask on rows `out` [R, C] (column c: token cols[c], or token c)."""
        if not self.penalties.off:
            out = self._penalise(out, paths, cols)
        if self.bias is not None:
            bias = self.bias.to(out.device)
            out += bias if cols is None else bias[cols]
        if masks is not None:
            if cols is None:
                out = apply_masks(out, masks)
            else:  # the mask over the whole vocabulary, read at the draft's columns
                full = apply_masks(torch.zeros(out.shape[0], self.vocab_size, device=out.device), masks)
                out = out + full[:, cols]
        return out

    def _penalise(self, logits: torch.Tensor, paths: list[list[int]], cols: torch.Tensor | None = None) -> torch.Tensor:
        pen, dev = self.penalties, logits.device
        counts = self.counts.to(dev).expand(len(paths), -1).clone()  # [R, V]
        rows = [r for r, path in enumerate(paths) for _ in path]
        if rows:
            toks = torch.tensor([t for path in paths for t in path], device=dev)
            counts.index_put_((torch.tensor(rows, device=dev), toks), torch.ones(len(rows), device=dev),
                              accumulate=True)
        seen = self.seen.to(dev) | (counts > 0) if pen.repetition != 1 else None
        if cols is not None:
            counts = counts[:, cols]
            seen = seen[:, cols] if seen is not None else None
        if seen is not None:
            scaled = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
            logits = torch.where(seen, scaled, logits)
        return logits - pen.frequency * counts - pen.presence * (counts > 0).float()

    def commit(self, tokens: Sequence[int]) -> None:
        """The row emitted `tokens` (in order)."""
        for t in tokens:
            if t < self.vocab_size:
                self.counts[t] += 1
                self.seen[t] = True
        if self.matcher is not None:
            self.matcher.commit(tokens)

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (none without a grammar)."""
        return self.matcher.forced() if self.matcher is not None else []


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token (raw logits), with its most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [R, V] (row j scored tokens[j]) -> each token's log-probability and the `top` best."""
    if not len(tokens):
        return []
    lp = torch.log_softmax(logits.float(), -1)
    ids = torch.tensor(list(tokens), device=lp.device)
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()
    if top > 0:
        vals, idx = lp.topk(top, -1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(c), tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]
