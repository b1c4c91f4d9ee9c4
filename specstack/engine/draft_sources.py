"""Draft sources (`DraftSources`): where a method's drafts come from — a draft model (a registered or
local model, a trained draft file, the target's own first blocks, MagicDec's window), its weight format,
FR-Spec's restricted head, and the trigram — merged once from the command line and the model's registry
entry, and loaded once per method (engine/methods.py builds the drafters on them), or once per process
where the sources carry a `DraftShelf` (the server: requests pick methods, each loading nothing twice). A
draft spec is parsed once by models/drafts.py; each kind of spec has its loader in DRAFT_LOADERS."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from specstack.config import WindowSpec
from specstack.drafting.katz import KatzTrigram
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.draft_file import load_draft_file
from specstack.models.drafts import DraftKind, DraftSpec, choose_draft, shipped_draft
from specstack.models.huge_pages import move_to_huge_pages
from specstack.models.loading import load_model
from specstack.models.quant import default_format
from specstack.models.registry import default_draft_vocab, default_ngram_path, token_rank_path
from specstack.models.transformer import Transformer
from specstack.prefix_cache import PrefixCache

T = TypeVar("T")


class DraftShelf:
    """What the methods built on one DraftSources share in a long-lived process (the server, where each
    request may pick a method): each draft model loaded once, one prefix cache per draft model (its keys
    are the draft's, whichever method drafts with it), the trigram read once. So a server's memory holds
    one of each however many methods its requests name. Without a shelf every method loads its own (a
    bench measures each method from cold)."""

    def __init__(self) -> None:
        self._items: dict[tuple[Any, ...], tuple[object, Any]] = {}

    def get(self, kind: str, owner: object, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """The `kind` item of `owner` (kept alive beside it, so its id stays its own) for `key` (what else
        the item depends on: the sources, the budget), made once."""
        k = (kind, id(owner), *key)
        if k not in self._items:
            self._items[k] = (owner, make())
        return self._items[k][1]

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------------------------------------------
# Draft sources
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftSources:
    """Where drafts come from. draft: a draft spec (models/drafts.py: a model name/path, a trained draft
    file, `default`, `self:N`, `magicdec:W`), None for the target's first eighth of blocks; draft_dtype:
    the weight format of a loaded draft; ngram: a trained trigram file, or `default`/None for the one
    shipped for the target. draft_dtype None: int8 for a trained draft (faster than bf16 at one row,
    where int4 costs it acceptance: docs/bench-history, "The draft's weight format"), and for a model or
    self:N draft the format a target gets by default on the device (quant.default_format: w4a8 where
    its kernels build, whose one-token step is the fastest there; int4 elsewhere)."""

    draft: str | None = None
    draft_dtype: str | None = None
    ngram: str | None = None
    draft_vocab: int | None = None  # FR-Spec: the draft's head over the target's K most frequent tokens
    vocab_by_default: bool = False  # draft_vocab is the registry's: a draft whose head cannot be cut keeps it
    # the most a draft model's prefix cache (prefix_cache.py) may keep, shared by the drafters of one
    # method; 0: each drafter runs its whole prompt through the draft
    prefix_cache_bytes: int = 0
    shelf: DraftShelf | None = field(default=None, compare=False, repr=False)  # shared loads (DraftShelf)

    def draft_prefix(self, draft: LoadedModel) -> PrefixCache | None:
        """The prefix cache of `draft`'s keys and values (None: none): a new one per method, or the
        draft's one on the shelf."""
        if self.prefix_cache_bytes <= 0:
            return None
        if self.shelf is None:
            return PrefixCache(self.prefix_cache_bytes)
        return self.shelf.get("prefix", draft, (self.prefix_cache_bytes,), lambda: PrefixCache(self.prefix_cache_bytes))

    @classmethod
    def for_model(cls, model_name: str, draft: str | None = None, draft_dtype: str | None = None,
                  ngram: str | None = None, draft_vocab: int | None = None) -> DraftSources:
        """The sources a user asked for, the draft and the draft's vocabulary not given taken from the
        model's registry entry: the one place where command-line choices and per-model defaults merge.
        draft_vocab 0: the draft's full head, whatever the entry says."""
        shipped = shipped_draft(model_name)
        if draft is None and shipped is not None:
            draft = str(shipped)
        registry_vocab = default_draft_vocab(model_name)
        by_default = draft_vocab is None and registry_vocab is not None
        if by_default:
            draft_vocab = registry_vocab
        return cls(draft=draft, draft_dtype=draft_dtype, ngram=ngram, draft_vocab=draft_vocab or None,
                   vocab_by_default=by_default)

    def draft_format(self, spec: DraftSpec, device: str = "cpu") -> str:
        if self.draft_dtype is not None:
            return self.draft_dtype
        return "int8" if spec.kind == DraftKind.FILE else default_format(device)


@dataclass(frozen=True)
class DraftModel:
    lm: LoadedModel
    window: WindowSpec | None = None  # a sliding-window KV for the draft's cache


def self_draft(target_name: str, n_layers: int, dtype: str, device: str) -> LoadedModel:
    """The target's first `n_layers` blocks with its final norm and head (MagicDec-style self-draft
    without training), loaded in `dtype` so the draft can be quantised while the target is not."""
    full = load_model(target_name, dtype=dtype, device=device, tokenizer=False)
    assert isinstance(full.model, Transformer)  # what load_model builds (LoadedModel holds any DecoderModel)
    model = full.model.first_layers(n_layers)
    return LoadedModel(f"{full.name}[:{n_layers}]", model, None, model.config, dtype, source=full.source)


def _model_draft(target: LoadedModel, spec: DraftSpec, fmt: str, device: str) -> DraftModel:
    draft = load_model(spec.source, dtype=fmt, device=device, tokenizer=False)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecstackError(f"draft {spec.source!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                             f"the target {target.config.vocab_size}: they must share a tokenizer")
    return DraftModel(draft)


# draft spec kind -> (target, resolved spec, the draft's weight format, device) -> the draft; `default`
# never reaches a loader (DraftSpec.resolved turns it into its file)
DRAFT_LOADERS: dict[DraftKind, Callable[[LoadedModel, DraftSpec, str, str], DraftModel]] = {
    DraftKind.SELF: lambda target, spec, fmt, device: DraftModel(
        self_draft(target.source or target.name, spec.size, fmt, device)),
    # MagicDec: the target itself, as it is loaded, drafting with a sliding-window KV of 1 sink + W
    DraftKind.MAGICDEC: lambda target, spec, fmt, device: DraftModel(target, WindowSpec(1, spec.size)),
    # a trained draft (specstack train-draft), sharing the target's embeddings
    DraftKind.FILE: lambda target, spec, fmt, device: DraftModel(load_draft_file(spec.source, target, fmt)),
    DraftKind.MODEL: _model_draft,
}


def resolve_draft(target: LoadedModel, sources: DraftSources, device: str) -> DraftModel:
    """The draft named by sources.draft (see DraftSources), with its window if it has one (loaded once
    per target, sources and device where the sources have a shelf)."""
    if sources.shelf is None:
        return _resolve_draft(target, sources, device)
    return sources.shelf.get("draft", target, (sources, device), lambda: _resolve_draft(target, sources, device))


def _resolve_draft(target: LoadedModel, sources: DraftSources, device: str) -> DraftModel:
    spec = choose_draft(sources.draft, target.config.n_layers).resolved(target.name)
    drafted = DRAFT_LOADERS[spec.kind](target, spec, sources.draft_format(spec, device), device)
    if sources.draft_vocab is None or (sources.vocab_by_default and not isinstance(drafted.lm.model, Transformer)):
        return drafted
    return DraftModel(restricted_head(drafted.lm, target, sources.draft_vocab), drafted.window)


def restricted_head(draft: LoadedModel, target: LoadedModel, k: int) -> LoadedModel:
    """The draft with its head over the target's `k` most frequent tokens (FR-Spec; the ranking ships
    with the target's registry entry) and its tokenizer's special tokens (end of text, the chat and
    fill-in-the-middle markers: a corpus ranking holds none, and a draft that cannot propose the end of a
    turn misses it every turn). The target verifies over the full vocabulary: same output."""
    path = token_rank_path(target.name)
    if path is None:
        raise SpecstackError(f"--draft-vocab: no token ranking ships for {target.name} (benchmarks/draft_vocab.py "
                             "makes one)")
    ranked = np.load(path)
    if not 1 <= k <= len(ranked):
        raise SpecstackError(f"--draft-vocab must be in [1, {len(ranked)}] for {target.name} (0: the full "
                             f"vocabulary), got {k}")
    model = draft.model
    if not isinstance(model, Transformer):
        raise SpecstackError(f"--draft-vocab: the draft {draft.name} is not a plain decoder (its head cannot be cut)")
    special = {*target.eos_token_ids, *(target.tokenizer.added_tokens_encoder.values() if target.tokenizer else ())}
    kept = np.union1d(ranked[:k], np.fromiter(special, dtype=np.int64, count=len(special)))
    small = model.with_head_over(torch.from_numpy(kept.astype(np.int64)))
    move_to_huge_pages(small.head.buffers())  # the cut head is new memory; the rest is the draft's
    return LoadedModel(f"{draft.name}[vocab {k}]", small, draft.tokenizer, small.config, draft.fmt, source=draft.source)


def load_draft(target: LoadedModel, sources: DraftSources, device: str) -> LoadedModel:
    """The draft model alone (its window, if any, in resolve_draft)."""
    return resolve_draft(target, sources, device).lm


def load_ngram(target: LoadedModel, sources: DraftSources) -> KatzTrigram:
    """The trigram of sources.ngram for `target` (read once where the sources have a shelf)."""
    if sources.shelf is None:
        return _load_ngram(target, sources)
    return sources.shelf.get("ngram", target, (sources.ngram,), lambda: _load_ngram(target, sources))


def _load_ngram(target: LoadedModel, sources: DraftSources) -> KatzTrigram:
    path = sources.ngram
    if path in (None, "default"):
        found = default_ngram_path(target.name)
        if found is None:
            raise SpecstackError(f"no default n-gram model for {target.name}: pass --ngram FILE "
                                 "(train one with `specstack ngram train`)")
        path = str(found)
    if not Path(path).is_file():
        raise SpecstackError(f"n-gram file not found: {path}")
    model = KatzTrigram.load(path)
    model.check_vocab(target.config.vocab_size)
    return model


