"""The model interface (DESIGN §1, §3): what the engine and the drafters may call on a decoder.

Terms:
- decoder: a model that maps new tokens [B, T], placed by an AttentionBatch (positions and the mask,
  from attention.py), to next-token logits, writing their keys/values to a KVCache's scratch slots.
  The target Transformer, a self-draft (the target's first layers) and a SPIRe draft are decoders;
  `DecoderModel` is the surface they share and the only one the engine and the drafters use.
- ModelOutput: what a forward returns (logits of the rows asked for, hidden states, the logits'
  token ids for a draft with a reduced vocabulary).
- LoadedModel: a decoder with its name, tokenizer, config and weight format, as loading hands it out.
- target activations: a draft that reads the target's hidden states for the tokens the target has
  verified (SPIRe §(d)) declares it by satisfying `ReadsTargetActivations`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specstack.attention import AttentionBatch, build_batch
from specstack.cache import KVCache
from specstack.config import ModelConfig, WindowSpec


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T', V'] float32: the rows asked for (all T by default)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, d]
    # the token id of each logits column when the model scores only part of the vocabulary (a SPIRe
    # draft's reduced vocabulary); None: V' = V, column j is token j
    vocab_ids: torch.Tensor | None = None


@runtime_checkable
class DecoderModel(Protocol):
    """What the engine (the target) and the model drafters (every draft) call on a decoder."""

    config: ModelConfig  # the shape: n_layers, d_model, vocab_size, max_seq_len, ...

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch_size: int = 1, capacity: int | None = None,
                  window: WindowSpec | None = None, max_rows: int | None = None,
                  max_capacity: int | None = None) -> KVCache:
        """A cache for `batch_size` rows of `capacity` slots, grown on demand up to `max_capacity`
        (cache.cache_slots; default: from a few slots up to the context plus one block of scratch);
        window: a sliding-window KV (None: the model's own choice, full for the target);
        max_rows: rows allocated for a batch that grows and shrinks (KVCache.add_row)."""
        ...

    def forward(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                hidden_layers: Sequence[int] = (), logit_rows: slice | torch.Tensor = slice(None)) -> ModelOutput:
        """tokens [B, T] -> logits [B, T', V'] (fp32) of the rows `logit_rows` (positions, or flat indices
        into the B x T tokens: T' of them); their keys/values go to the cache's scratch, invisible until
        committed. hidden_layers: 0 = the embeddings, i = the output of block i, each [B, T, d] in out.hidden."""
        ...

    def extend(self, tokens: torch.Tensor, cache: KVCache, hidden_layers: Sequence[int] = (),
               logit_rows: slice | torch.Tensor = slice(None)) -> ModelOutput:
        """Run tokens [B, T] as the continuation of every row and commit them all (prefill, decode)."""
        ...


class Extends:
    """`extend` from `forward`: a decoder class lists this among its bases, so every decoder commits
    a continuation the same way (one definition)."""

    def extend(self: DecoderModel, tokens: torch.Tensor, cache: KVCache, hidden_layers: Sequence[int] = (),
               logit_rows: slice | torch.Tensor = slice(None)) -> ModelOutput:
        """Run tokens [B, T] as the continuation of every row and commit them all (prefill, decode)."""
        out = self.forward(tokens, build_batch(cache, tokens.shape[1]), cache, hidden_layers, logit_rows)
        cache.commit_all()
        return out


# Reading the target's activations is a capability of some drafts (SPIRe), not of decoders: it is a
# protocol of its own, checked once when a drafter is built, rather than members every decoder must
# carry as no-ops (a target with `write_memories` that can never be called says nothing true).
@runtime_checkable
class ReadsTargetActivations(Protocol):
    """A draft whose cache takes the tokens the target verified from the target's hidden states,
    without running them itself."""

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        """Target hidden layers (0 = embeddings, i = output of block i) it reads per verified token;
        () when this draft runs every token itself after all (a SPIRe draft without (d))."""
        ...

    def write_memories(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                       counts: Sequence[int] | None = None) -> None:
        """Commit verified tokens [1, T] to the cache from the target's hidden states [1, T, L, d]
        (L = len(target_hidden_layers), in that order); counts: the tokens are packed, cache row b
        taking counts[b] of them (default: all T to the cache's one row)."""
        ...


@dataclass
class LoadedModel:
    name: str
    model: DecoderModel
    tokenizer: Any  # a transformers tokenizer (no common type to name), or None for weights without one
    config: ModelConfig
    fmt: str
    source: str = ""  # what load_model was given (a registry name or a path): reloads the same model

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))
