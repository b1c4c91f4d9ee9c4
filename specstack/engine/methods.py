"""Decoding methods by name, with parameters: `ar`, `chain:k=4`, `tree:width=4,budget=36,depth=8`,
`ngram`, `staged:budget=36,depth=8`. The engine never branches on a drafter's kind: a method is
just a recipe that builds a drafter (or none, for autoregressive decoding)."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from specstack.config import GenerationConfig, WindowSpec
from specstack.drafting.base import Drafter
from specstack.engine.autoregressive import GenerationResult, generate
from specstack.engine.speculative import speculative_generate
from specstack.errors import SpecstackError
from specstack.models.loading import LoadedModel, load_model


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params.items()) if self.params else "")


@dataclass(frozen=True)
class DraftSources:
    """Where drafts come from. draft: a model name/path, a trained draft file (.safetensors), `default`
    (the trained draft shipped for the target), `self:N` (the target's first N layers and its head,
    loaded in draft_dtype) or `magicdec:W`; ngram: a trained trigram file or `default`.
    draft_dtype None: int8 for a trained draft (faster than bf16 at one row, where int4 costs it
    acceptance: docs/BENCHMARKS.md, "The draft's weight format"), int4 for a model or self:N draft."""

    draft: str | None = None
    draft_dtype: str | None = None
    ngram: str | None = None

    @classmethod
    def for_model(cls, model_name: str, draft: str | None = None, draft_dtype: str | None = None,
                  ngram: str | None = None) -> DraftSources:
        """The sources a user asked for, each one not given taken from the model's defaults: the one
        place where command-line choices and per-model defaults merge."""
        defaults = DEFAULT_SOURCES.get(model_name, cls())
        return cls(draft=draft or defaults.draft, draft_dtype=draft_dtype or defaults.draft_dtype,
                   ngram=ngram or defaults.ngram)

    def draft_format(self, spec: str) -> str:
        if self.draft_dtype is not None:
            return self.draft_dtype
        return "int8" if spec.endswith(".safetensors") else "int4"


# defaults for the embedded model: the shipped SPIRe draft (specstack/data, docs/BENCHMARKS.md has the
# command that trained it) and the shipped code trigram (see README)
DEFAULT_SOURCES: dict[str, DraftSources] = {
    "smollm2-135m": DraftSources(draft="default", ngram="default"),
}

# method -> parameters it accepts (all integers) with their defaults
METHOD_PARAMS: dict[str, dict[str, int]] = {
    "ar": {},
    "chain": {"k": 4},
    # cost=1 (tree, staged): verify each step only the best nodes that pay for their width, by the
    # draft's path probabilities and the target's measured forward cost per width (greedy and staged)
    "tree": {"width": 4, "budget": 36, "depth": 8, "expand": 4, "cost": 0},
    # a 3-token chain suits the default int4 target, whose forward cost grows with every token;
    # on a bf16 target (wide forwards nearly free) width=12,depth=6 accepts more (docs/BENCHMARKS.md).
    # max=M > 0: a chain whose length follows BASS's dynamic rule, from `depth` up to M (0 = fixed);
    # with cost=1 instead the length (up to M) that maximises expected tokens per second, from the
    # target's measured forward cost per width and acceptance learned per evidence class
    # match=N: the longest suffix the context lookup matches (a longer match is both a surer proposal
    # and, for cost=1, sharper evidence)
    "ngram": {"width": 1, "depth": 3, "max": 0, "cost": 0, "match": 3},
    # d2: draft2's proposal under each spine token: 0 = the paper's tree (widths 12, 7, 4, 1, 1, 1),
    # N = a chain of N tokens (a narrower draft forward: on the 2-core CPU it pays, docs/BENCHMARKS.md)
    "staged": {"width": 4, "budget": 36, "depth": 8, "cost": 0, "d2": 0},
}


def parse_method(text: str) -> MethodSpec:
    name, _, rest = text.strip().partition(":")
    if name not in METHOD_PARAMS:
        raise SpecstackError(f"unknown method {name!r}; choose from {', '.join(METHOD_PARAMS)}")
    params = dict(METHOD_PARAMS[name])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in params:
            known = ", ".join(params) or "none"
            raise SpecstackError(f"method {name!r}: bad parameter {item!r} (parameters: {known})")
        try:
            params[key] = int(value)
        except ValueError:
            raise SpecstackError(f"method {name!r}: {key} must be an integer, got {value!r}") from None
        low = 0 if METHOD_PARAMS[name][key] == 0 else 1  # a parameter whose default is 0 means "off" at 0
        if params[key] < low:
            raise SpecstackError(f"method {name!r}: {key} must be >= {low}, got {params[key]}")
    if params.get("max") and (params["width"] != 1 or params["depth"] > params["max"]):
        raise SpecstackError(f"method {name!r}: a dynamic chain (max={params['max']}) needs width=1 and "
                             f"depth <= max, got width={params['width']}, depth={params['depth']}")
    if name != "ngram" and params.get("cost", 0) > 1:
        raise SpecstackError(f"method {name!r}: cost is 0 or 1, got {params['cost']}")
    if name == "ngram" and params["cost"] and (params["cost"] != 1 or not params["max"]):
        raise SpecstackError(f"method {name!r}: cost=1 chooses each chain's length up to max=M: give max=M "
                             f"(and cost is 0 or 1), got cost={params['cost']}, max={params['max']}")
    return MethodSpec(name, params)


def self_draft(target_name: str, n_layers: int, dtype: str, device: str) -> LoadedModel:
    """The target's first `n_layers` blocks with its final norm and head (MagicDec-style self-draft
    without training), loaded in `dtype` so the draft can be quantised while the target is not."""
    full = load_model(target_name, dtype=dtype, device=device, tokenizer=False)
    if not 1 <= n_layers <= full.config.n_layers:
        raise SpecstackError(f"self-draft: {n_layers} layers requested, the model has {full.config.n_layers}")
    model = copy.copy(full.model)  # shallow: shares embedding, norm, head and the kept blocks
    model._modules = dict(full.model._modules)
    model.layers = nn.ModuleList(list(full.model.layers)[:n_layers])
    model.config = replace(full.config, n_layers=n_layers)
    return LoadedModel(f"{full.name}[:{n_layers}]", model, None, model.config, dtype, source=full.source)


@dataclass(frozen=True)
class DraftModel:
    lm: LoadedModel
    window: WindowSpec | None = None  # a sliding-window KV for the draft's cache


def load_draft(target: LoadedModel, sources: DraftSources, device: str) -> LoadedModel:
    """The draft model alone (its window, if any, in resolve_draft)."""
    return resolve_draft(target, sources, device).lm


def resolve_draft(target: LoadedModel, sources: DraftSources, device: str) -> DraftModel:
    """The draft named by sources.draft: a model name/path, a trained draft file (.safetensors from
    `specstack train-draft`), `self:N`, or `magicdec:W` (MagicDec: the target itself, as it is loaded,
    drafting with a sliding-window KV of 1 sink + W positions)."""
    spec = sources.draft or f"self:{max(1, target.config.n_layers // 8)}"
    if spec == "default":
        from specstack.models.draft_file import resolve_default_draft

        spec = resolve_default_draft(spec, target.name)
    if spec.startswith("magicdec:"):
        try:
            w = int(spec.removeprefix("magicdec:"))
        except ValueError:
            raise SpecstackError(f"--draft {spec!r}: expected magicdec:W with a window of W tokens") from None
        return DraftModel(target, WindowSpec(1, w))
    return DraftModel(_load_draft_model(target, spec, sources, device))


def _load_draft_model(target: LoadedModel, spec: str, sources: DraftSources, device: str) -> LoadedModel:
    if spec.endswith(".safetensors"):  # a trained draft (specstack train-draft), sharing the target's embeddings
        from specstack.models.draft_file import load_draft_file

        return load_draft_file(spec, target, sources.draft_format(spec))
    if spec.startswith("self:"):
        try:
            n = int(spec.removeprefix("self:"))
        except ValueError:
            raise SpecstackError(f"--draft {spec!r}: expected self:N with N layers") from None
        return self_draft(target.source or target.name, n, sources.draft_format(spec), device)
    draft = load_model(spec, dtype=sources.draft_format(spec), device=device, tokenizer=False)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecstackError(f"draft {spec!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                             f"the target {target.config.vocab_size}: they must share a tokenizer")
    return draft


def load_ngram(target: LoadedModel, sources: DraftSources) -> Any:
    from specstack.drafting.katz import KatzTrigram, default_ngram_path

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


def tree_budget(target: LoadedModel, p: dict[str, int]) -> Any:
    """cost=1: a CostAwareBudget over the target's forward costs of widths 1 .. budget + 1
    (measured once per machine and target format: engine/width_cost.py)."""
    if not p["cost"]:
        return None
    from specstack.drafting.draft_length import CostAwareBudget
    from specstack.engine.width_cost import width_costs

    return CostAwareBudget(width_costs(target, p["budget"] + 1))


def build_drafter(method: MethodSpec, target: LoadedModel, sources: DraftSources, device: str = "cpu") -> Drafter | None:
    from specstack.drafting.model import ModelDrafter, TreeParams

    p = method.params
    if method.name == "ar":
        return None
    if method.name == "chain":
        d = resolve_draft(target, sources, device)
        return ModelDrafter(d.lm, TreeParams.chain(p["k"]), window=d.window)
    if method.name == "tree":
        d = resolve_draft(target, sources, device)
        return ModelDrafter(d.lm, TreeParams(p["width"], p["budget"], p["depth"], p["expand"]), window=d.window,
                            budget=tree_budget(target, p))
    if method.name == "ngram":
        from specstack.drafting.draft_length import (
            ChainLength,
            CostAwareLength,
            DynamicDraftLength,
        )
        from specstack.drafting.ngram import NgramDrafter
        from specstack.engine.width_cost import width_costs

        length: ChainLength | None = None
        if p["cost"]:  # the target's forward costs of widths 1 .. max + 1 (measured once, then stored)
            length = CostAwareLength(width_costs(target, p["max"] + 1))
        elif p["max"]:
            length = DynamicDraftLength(start=p["depth"], cap=p["max"])
        return NgramDrafter(load_ngram(target, sources), widths=(p["width"],) + (1,) * (p["depth"] - 1),
                            max_n=p["match"], length=length)
    if method.name == "staged":
        from specstack.drafting.ngram import STAGED_WIDTHS, NgramDrafter
        from specstack.drafting.staged import StagedDrafter

        d = resolve_draft(target, sources, device)
        return StagedDrafter(d.lm, NgramDrafter(load_ngram(target, sources)),
                             TreeParams(p["width"], p["budget"], p["depth"]), window=d.window,
                             widths=(1,) * p["d2"] if p["d2"] else STAGED_WIDTHS, budget=tree_budget(target, p))
    raise SpecstackError(f"unknown method {method.name!r}")  # parse_method keeps this unreachable


def run_method(target: LoadedModel, drafter: Drafter | None, prompt_ids: Sequence[int], gen: GenerationConfig,
               on_text: Callable[[str], None] | None = None) -> GenerationResult:
    if drafter is None:
        return generate(target, prompt_ids, gen, on_text=on_text)
    return speculative_generate(target, drafter, prompt_ids, gen, on_text=on_text)
