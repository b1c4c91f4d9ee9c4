"""Draft specs: where a draft comes from, parsed once from what the user wrote (`--draft`).

The forms (DraftSpec.kind):
    default           the draft registered for the target (models/registry.py): a trained draft shipped
                      in specstack/data, or a registered model (the 0.5B for Qwen2.5-Coder-1.5B);
                      `resolved` turns it into that file's path or that model's name
    NAME              a trained draft the target's registry entry names (`spire`), shipped in
                      specstack/data; `resolved` turns it into that file's path  kind "named"
                      (a name any registered model gives a draft; a folder so named is ./NAME)
    self:N            the target's first N blocks with its final norm and head
    magicdec:W        the target itself, drafting with a sliding-window KV of 1 sink + W positions
    FILE.safetensors  a trained draft (`specstack train-draft`)        kind "file"
    anything else     a model name or path (models/registry.py), sharing the target's tokenizer  kind "model"
A target given no draft takes the one shipped for it, else `fallback_draft`: its first eighth of blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from specstack.errors import SpecstackError
from specstack.models.registry import MODELS, default_draft_path, draft_names, named_draft_path


class DraftKind(StrEnum):
    DEFAULT = "default"
    SELF = "self"
    MAGICDEC = "magicdec"
    FILE = "file"
    MODEL = "model"
    NAMED = "named"


FILE_SUFFIX = ".safetensors"
# the sized forms, written KIND:SIZE -> the form expected (for the error message)
SIZED: dict[DraftKind, str] = {DraftKind.SELF: "self:N with N >= 1 layers",
                               DraftKind.MAGICDEC: "magicdec:W with a window of W >= 1 tokens"}


@dataclass(frozen=True)
class DraftSpec:
    kind: DraftKind
    source: str = ""  # file: its path; model: the model's name or path
    size: int = 0  # self: the blocks kept; magicdec: the window W

    @classmethod
    def parse(cls, text: str) -> DraftSpec:
        if not text.strip():
            raise SpecstackError("--draft is empty")
        if text == DraftKind.DEFAULT:
            return cls(DraftKind.DEFAULT)
        if text in draft_names():
            return cls(DraftKind.NAMED, source=text)
        prefix, colon, value = text.partition(":")
        if colon and prefix in SIZED:
            kind = DraftKind(prefix)
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise SpecstackError(f"--draft {text!r}: expected {SIZED[kind]}")
            return cls(kind, size=size)
        return cls(DraftKind.FILE if text.endswith(FILE_SUFFIX) else DraftKind.MODEL, source=text)

    def __str__(self) -> str:
        """The spec as written: DraftSpec.parse(str(spec)) == spec."""
        return f"{self.kind}:{self.size}" if self.kind in SIZED else (self.source or self.kind)

    def resolved(self, model_name: str) -> DraftSpec:
        """`default` -> the file of the draft shipped for `model_name` (a clear error when none ships);
        a named draft -> its file, shipped for `model_name` (else a clear error); any other spec unchanged."""
        if self.kind == DraftKind.NAMED:
            path = named_draft_path(model_name, self.source)
            if path is None:
                names = ", ".join(sorted(MODELS[model_name].drafts)) if model_name in MODELS else ""
                raise SpecstackError(f"no draft named {self.source!r} ships for {model_name} (its named drafts: "
                                     f"{names or 'none'}): pass a draft file (`specstack train-draft --target "
                                     f"{model_name}` makes one), a model, self:N or magicdec:W")
            return DraftSpec(DraftKind.FILE, source=str(path))
        if self.kind != DraftKind.DEFAULT:
            return self
        entry = MODELS.get(model_name)
        if entry is not None and entry.draft_model:
            return DraftSpec(DraftKind.MODEL, source=entry.draft_model)
        found = default_draft_path(model_name)
        if found is None:
            raise SpecstackError(f"no trained draft ships for {model_name}: pass --draft (a model, a file from "
                                 "`specstack train-draft`, self:N or magicdec:W)")
        return DraftSpec(DraftKind.FILE, source=str(found))


def fallback_draft(n_layers: int) -> DraftSpec:
    """The draft of a target with none named or shipped: its first eighth of blocks (at least one)."""
    return DraftSpec(DraftKind.SELF, size=max(1, n_layers // 8))


def shipped_draft(model_name: str) -> DraftSpec | None:
    """`default` when the registry names a draft (trained or a model) for the model, else None."""
    entry = MODELS.get(model_name)
    return DraftSpec(DraftKind.DEFAULT) if entry is not None and (entry.draft or entry.draft_model) else None


def choose_draft(given: str | None, n_layers: int, model_name: str | None = None) -> DraftSpec:
    """The draft for a target of `n_layers` blocks: the one given, else (when `model_name` is given)
    the one shipped for the model, else the fallback."""
    if given:
        return DraftSpec.parse(given)
    return (shipped_draft(model_name) if model_name else None) or fallback_draft(n_layers)
