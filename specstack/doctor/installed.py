"""What is installed: the extras (from the installed metadata), llama.cpp's peer binaries and the
registered models, each missing one with its fix: sections 4-5 of the report."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from specstack.bench.llama_build import SCRIPT as LLAMA_BUILD
from specstack.bench.llama_build import cmake_args
from specstack.doctor.report import Extra, Model, PeerBinary
from specstack.errors import SpecstackError


# ---------------------------------------------------------------------------------------------------
# 4. Extras and peer binaries
# ---------------------------------------------------------------------------------------------------
def extra_requirements(dist: str = "specstack") -> dict[str, list[Requirement]]:
    """Each extra of an installed distribution and its requirements, from its metadata (so the list is
    the one pip installed from, never a copy that could drift from pyproject.toml)."""
    try:
        extras = importlib.metadata.metadata(dist).get_all("Provides-Extra") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed: none known
        return {}
    return {extra: requirements_of(dist, extra) for extra in extras}


def requirements_of(dist: str, extra: str) -> list[Requirement]:
    """The requirements `extra` of `dist` adds on this Python and platform (none that the base needs)."""
    out = []
    for line in importlib.metadata.requires(dist) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def requirement_text(req: Requirement) -> str:
    """`name[extras]specifier`, without the marker (`extra == "peers"` says nothing a reader needs)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def unmet(req: Requirement, seen: set[tuple[str, str]] | None = None) -> list[str]:
    """Why `req` is not satisfied here (empty: it is), its own extras' requirements included."""
    seen = set() if seen is None else seen
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return [f"{requirement_text(req)} (not installed)"]
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return [f"{requirement_text(req)} ({req.name} {version} is installed)"]
    out = []
    for extra in sorted(req.extras):
        if (req.name, extra) in seen:
            continue
        seen.add((req.name, extra))
        for sub in requirements_of(req.name, extra):
            out += [f"{m} (for {req.name}[{extra}])" for m in unmet(sub, seen)]
    return out


def pip_install(extra: str, env: str = "", dist: str = "specstack") -> str:
    """The command that installs `extra` (with `env`, variables for pip, before it): from the source tree
    when specstack runs from one (an editable install: pyproject.toml beside the package), else the index."""
    tree = Path(__file__).resolve().parent.parent
    if (tree / "pyproject.toml").is_file():
        return f'cd {tree} && {env}pip install -e ".[{extra}]"'
    return f'{env}pip install "{dist}[{extra}]"'


def extras(requirements: dict[str, list[Requirement]] | None = None, flags: set[str] | None = None) -> list[Extra]:
    requirements = extra_requirements() if requirements is None else requirements
    out = []
    for name, reqs in requirements.items():
        seen: set[tuple[str, str]] = set()
        missing = [m for r in reqs for m in unmet(r, seen)]
        fix = None
        if missing and any(canonicalize_name(r.name) == "llama-cpp-python" for r in reqs):
            # pip builds llama.cpp from source for this CPU, and its default turns AMX on (a crash on some Xeons)
            fix = (pip_install(name, f'CMAKE_ARGS="{cmake_args(flags)}" ')
                   + f"  (the flags of {LLAMA_BUILD}, for this CPU)")
        elif missing:
            fix = pip_install(name)
        out.append(Extra(name, [requirement_text(r) for r in reqs], missing, not missing, fix))
    return out


def peer_binaries() -> list[PeerBinary]:
    """llama.cpp's programs the benchmarks run beside specstack, found as they look for them."""
    from specstack.bench import llama_batched, llama_bench, llama_server

    wanted = ((llama_batched.BINARY, "specstack bench's llamacpp-batched peer", ""),
              (llama_server.BINARY, "specstack bench-serve's llama.cpp peer", ""),
              (llama_bench.BINARY, "specstack bench-forward's llama.cpp column", f"LLAMA_CPP_EXTRA={llama_bench.BINARY} "))
    out = []
    for binary, use, env in wanted:
        path, _ = llama_batched.find_binary(None, binary)
        fix = None if path else (f"{env}{LLAMA_BUILD} (or put it on PATH, or set {llama_batched.ENV_BIN_DIR} to "
                                 "its folder)")
        out.append(PeerBinary(binary, use, None if path is None else str(path), fix))
    return out


# ---------------------------------------------------------------------------------------------------
# 5. Registered models
# ---------------------------------------------------------------------------------------------------
def _converted(name: str, gguf: Path) -> list[str]:
    """The converted weight files the cache holds for this GGUF (models/loading.model_cache_dir)."""
    from specstack.models.loading import model_cache_dir
    from specstack.models.registry import ModelSource

    try:
        folder = model_cache_dir(ModelSource(name, "gguf", gguf))  # hashes the GGUF once, if no record names it
    except OSError:
        return []
    return sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def models() -> list[Model]:
    from specstack.models.registry import DEFAULT_MODEL, MODELS

    out = []
    for name, entry in MODELS.items():
        default = name == DEFAULT_MODEL
        try:
            if entry.chunked is None:
                gguf: Path | None = entry.weights()  # found through the installed package: nothing is built
                detail = f"in the installed package {entry.package}"
            else:
                parts = entry.chunked.parts()  # every part installed, at its version
                gguf = entry.chunked.cached()
                size = f"{entry.chunked.size / 1e9:.1f} GB"
                detail = (f"its {len(parts)} parts are installed; "
                          + ("assembled in the cache" if gguf else f"assembled into the cache on first use ({size})"))
        except SpecstackError as e:
            out.append(Model(name, default, False, None, str(e), [], entry.install))
            continue
        out.append(Model(name, default, True, None if gguf is None else str(gguf), detail,
                         [] if gguf is None else _converted(name, gguf), None))
    return out
