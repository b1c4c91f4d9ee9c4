"""What `specstack doctor` reports: the machine, what specstack chose on it, the cache folder, the
installed extras and peer binaries, the registered models, and the problems among them with their fixes.

Read only, and fast: nothing is compiled, assembled, loaded or written. The kernel tables are asked what
they would choose inside `native.planning()`, where a native kernel that is not built yet counts as
available when the CPU, the compiler and ninja are there (a run builds it on first use), so the answer
is the choice a run would make, from the same tables and the same rules (`kernel_table.choose`,
`quant.default_format`), not a second copy of them (a build that would fail for another reason, a
compiler error, is not foreseen: the run then says so on stderr and falls back).

A *problem* is something that makes specstack slower or stops it (no compiler where the CPU could run
the native kernels, a kernel variable naming a kernel that cannot run, the default model missing); a
missing extra, peer binary or other registered model is *optional*: listed with its fix, never counted.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from specstack.errors import SpecstackError
from specstack.files import cache_root
from specstack.machine import cpu_model, package_version

if TYPE_CHECKING:
    from specstack.models.kernel_table import KernelChoice

# The instruction sets that decide something here, and what (the kernels' own docstrings say more:
# models/native.py, models/w4a8.py, models/linear_methods.native_bf16)
CPU_FLAGS: tuple[tuple[str, str], ...] = (
    ("avx2", "every native kernel needs it; without it the default format is int4"),
    ("avx512f", "torch's AVX512 code; with avx512_vnni, w4a8's fastest paths"),
    ("avx512_vnni", "w4a8's wide512 and vnni512 paths (vpdpbusd on 512-bit vectors)"),
    ("avx512_bf16", "bf16 dot products in hardware (bf16 models, int4/int8 wide inputs)"),
    ("amx_tile", "unused by specstack; llama.cpp peers must be built with AMX off (it crashes on some Xeons)"),
    ("amx_int8", "as amx_tile"),
    ("avx_vnni", "256-bit VNNI: unused (specstack's VNNI paths are 512-bit)"),
)
# what each native kernel (models/kernels/<name>.cpp) is for
KERNEL_USES: dict[str, str] = {
    "w4a8": "w4a8's avx2 and vnni512 paths, and the default format w4a8",
    "w4a8_wide": "w4a8's wide512 path",
    "attention": "the fixed-order attention of the batch-invariant formats",
    "layer": "the native decoder: a forward's blocks in one call",
}
BUILD_TIME = "~15 s"  # a kernel's first build, roughly (native.load prints the real time when it builds one)
FIRST_BUILD = f"built on first use, {BUILD_TIME}"
COMPILER_FIX = "apt install g++ (or set CXX to a C++ compiler)"
NINJA_FIX = "pip install ninja"
# llama-cpp-python builds llama.cpp for the CPU it is installed on; these are benchmarks/build_llama_cpp.sh's
# flags: native detection off (it turns AMX on, which crashes on some of our Xeons), each ISA named
LLAMA_CMAKE_BASE = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
LLAMA_CMAKE_AVX512 = (("avx512f", "-DGGML_AVX512=ON"), ("avx512_vnni", "-DGGML_AVX512_VNNI=ON"),
                      ("avx512_bf16", "-DGGML_AVX512_BF16=ON"))
LLAMA_CMAKE_AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
LLAMA_BUILD = "benchmarks/build_llama_cpp.sh"


# ---------------------------------------------------------------------------------------------------
# The report's fields (the JSON of `--json` is these dataclasses as they are, plus the summary)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuFlag:
    name: str
    present: bool | None  # None: unknown (no /proc/cpuinfo on this system)
    why: str


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int | None  # os.cpu_count()
    usable_cores: int | None  # the cores this process may run on (its affinity)
    flags: list[CpuFlag]
    torch: str
    torch_capability: str  # what torch's CPU dispatcher found: DEFAULT, AVX2, AVX512, ...
    torch_threads: int
    python: str
    specstack: str | None


@dataclass(frozen=True)
class NativeKernel:
    name: str
    used_by: str
    state: str  # "built", "out of date", "not built", "cannot build", "not for this CPU"
    path: str | None  # the built library, when there is one
    note: str


@dataclass(frozen=True)
class KernelTable:
    name: str  # what the table computes
    env: str  # the variable that forces one of its entries
    entries: list[str]  # every entry, fastest first
    usable: list[str]  # those that apply on this CPU
    chosen: str | None  # None: the forced value is refused (`error`)
    forced: str | None  # the variable's value, when set
    error: str | None  # what a run would stop with


@dataclass(frozen=True)
class Choices:
    default_dtype: str  # `--dtype` when not given, on cpu
    default_dtype_why: str
    compiler: str  # what torch's extension builder runs: $CXX, else c++
    compiler_path: str | None
    ninja_path: str | None
    native_problem: str | None  # why native kernels cannot be had here (None: they can)
    native_consequence: str | None  # what that means for a run
    native_fix: str | None  # how to get them (None: nothing to do, e.g. a CPU without AVX2)
    bf16_native: bool
    kernels: list[NativeKernel]
    tables: list[KernelTable]


@dataclass(frozen=True)
class CacheEntry:
    path: str  # relative to the cache folder
    bytes: int
    what: str


@dataclass(frozen=True)
class Cache:
    root: str
    from_env: bool  # SPECSTACK_CACHE names it
    exists: bool
    bytes: int
    entries: list[CacheEntry]


@dataclass(frozen=True)
class Extra:
    name: str
    requirements: list[str]
    missing: list[str]  # the requirements not met, each with why
    installed: bool
    fix: str | None


@dataclass(frozen=True)
class PeerBinary:
    name: str
    used_by: str
    path: str | None
    fix: str | None


@dataclass(frozen=True)
class Model:
    name: str
    default: bool  # the model every command runs without --model
    present: bool  # its files are here (a chunked model's parts count: they are assembled on first use)
    path: str | None  # its GGUF, when it is a file already
    detail: str
    converted: list[str]  # its converted weight files in the cache (one per format built)
    fix: str | None


@dataclass(frozen=True)
class Problem:
    section: str
    what: str
    fix: str


@dataclass(frozen=True)
class Report:
    machine: Machine
    choices: Choices
    cache: Cache
    extras: list[Extra]
    peer_binaries: list[PeerBinary]
    models: list[Model]
    problems: list[Problem] = field(default_factory=list)
    optional_missing: list[str] = field(default_factory=list)  # what is not installed and need not be

    def summary(self) -> str:
        optional = f" (not installed, optional: {', '.join(self.optional_missing)})" if self.optional_missing else ""
        if not self.problems:
            return "everything OK" + optional
        n = len(self.problems)
        return f"{n} problem{'s' if n > 1 else ''}: " + "; ".join(p.what for p in self.problems) + optional


# ---------------------------------------------------------------------------------------------------
# 1. The machine
# ---------------------------------------------------------------------------------------------------
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The flags the kernel reports for the first CPU (None where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def machine() -> Machine:
    import torch

    from specstack.models import native

    flags = cpu_flags()
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = None
    return Machine(cpu=cpu_model(), cores=os.cpu_count(), usable_cores=usable,
                   flags=[CpuFlag(n, None if flags is None else n in flags, why) for n, why in CPU_FLAGS],
                   torch=torch.__version__, torch_capability=native.cpu_capability(),
                   torch_threads=torch.get_num_threads(), python=platform.python_version(),
                   specstack=package_version("specstack"))


# ---------------------------------------------------------------------------------------------------
# 2. What specstack chose
# ---------------------------------------------------------------------------------------------------
def native_kernel(name: str, compiler_path: str | None, ninja_path: str | None) -> NativeKernel:
    """Kernel `name`'s state, from the cache folder and the tools (read only)."""
    from specstack.models import native

    use = KERNEL_USES.get(name, "")
    needs = native.CPU_FLAGS[name]
    if native.cpu_capability() not in needs:
        return NativeKernel(name, use, "not for this CPU", None,
                            f"needs torch CPU capability {' or '.join(needs)}; its reference path runs instead")
    library = native.built(name)
    missing = ("no C++ compiler" if compiler_path is None else "no ninja" if ninja_path is None else None)
    if missing is not None:  # native.supported / torch's builder refuse without them, built or not
        return NativeKernel(name, use, "cannot build", None if library is None else str(library),
                            f"{missing}: its reference path runs instead")
    if library is None:
        return NativeKernel(name, use, "not built", None, f"not built yet ({FIRST_BUILD})")
    if native.out_of_date(name):
        return NativeKernel(name, use, "out of date", str(library),
                            f"built, but its source changed since: rebuilt on first use, {BUILD_TIME}")
    return NativeKernel(name, use, "built", str(library), f"built ({library})")


def _table(name: str, kernels: tuple[KernelChoice[Any], ...], env: str) -> KernelTable:
    """What `choose` picks from a kernel table on this CPU, as a run would (call inside native.planning())."""
    import torch

    from specstack.models.kernel_table import choose

    cpu = torch.device("cpu")
    usable = [k.name for k in kernels if k.applies(cpu)]
    forced = os.environ.get(env) or None
    try:
        chosen, error = choose(kernels, env, cpu).name, None
    except SpecstackError as e:
        chosen, error = None, str(e)
    return KernelTable(name, env, [k.name for k in kernels], usable, chosen, forced, error)


def _decoder(w4a8_path: str | None, attention: str | None) -> KernelTable:
    """The decoder a w4a8 model gets (models/native_decoder.py: native where every linear has a C++ op
    and the fixed attention is in use; a model's own layers can still make it eager). Inside planning()."""
    from specstack.models import native, native_decoder, w4a8

    name, env, entries = "decoder (w4a8 models)", native_decoder.FORCE_ENV, list(native_decoder.DECODERS)
    native_paths = {*w4a8.PATH_SUFFIX, *w4a8.WIDE_PATHS}  # the w4a8 paths whose layers have a C++ op
    unfit = (f"the w4a8 kernel path is {w4a8_path or 'refused'}, not a C++ one" if w4a8_path not in native_paths
             else f"the batch-invariant attention is {attention or 'refused'}, not fixed" if attention != "fixed"
             else "the layer library cannot be built here" if not native.available("layer") else None)
    usable = ["eager"] if unfit else ["native", "eager"]
    forced = os.environ.get(env) or None
    try:
        native_decoder.forced_decoder()
    except SpecstackError as e:
        return KernelTable(name, env, entries, usable, None, forced, str(e))
    if forced == "native" and unfit:  # as native_decoder.native_decoder refuses it
        return KernelTable(name, env, entries, usable, None, forced, f"{env}=native: {unfit}")
    return KernelTable(name, env, entries, usable, "eager" if forced == "eager" or unfit else "native", forced, None)


def choices() -> Choices:
    from specstack.models import fixed_attention, native, w4a8, w8a8
    from specstack.models.linear_methods import native_bf16
    from specstack.models.quant import default_format

    cxx, cxx_path = native.compiler()
    ninja_path = native.ninja()
    kernels = [native_kernel(name, cxx_path, ninja_path) for name in native.CPU_FLAGS]
    capability = native.cpu_capability()
    problem = consequence = fix = None
    if capability not in native.CPU_FLAGS["w4a8"]:
        problem = f"native kernels cannot run on this CPU (torch reports capability {capability}: no AVX2)"
    elif cxx_path is None:
        where = f"CXX={cxx!r} not found" if os.environ.get("CXX") is not None else f"{cxx!r} is not on PATH"
        problem, fix = f"native kernels cannot be built: no C++ compiler ({where})", COMPILER_FIX
    elif ninja_path is None:
        problem, fix = "native kernels cannot be built or loaded: no ninja on PATH", NINJA_FIX
    if problem:
        consequence = ("the default format falls back to int4, and w4a8 and the batch-invariant attention run "
                       "their slow reference paths")
    with native.planning():  # what a run would choose, with nothing built now
        fmt = default_format("cpu")
        tables = [_table("w4a8 linear", w4a8.KERNELS, w4a8.FORCE_ENV),
                  _table("w8a8 linear", w8a8.KERNELS, w8a8.FORCE_ENV),
                  _table("batch-invariant attention", fixed_attention.KERNELS, fixed_attention.FORCE_ENV)]
        tables.append(_decoder(tables[0].chosen, tables[2].chosen))
    w4 = next(k for k in kernels if k.name == "w4a8")
    if fmt == "w4a8":
        when = {"built": "is built", "out of date": "is rebuilt on first use (its source changed)"}
        why = (f"this CPU has the w4a8 kernel's instructions ({capability}), and the kernel "
               + when.get(w4.state, f"is {FIRST_BUILD}"))
    else:
        why = problem or "the w4a8 kernel cannot be had here"
    return Choices(fmt, why, cxx, cxx_path, ninja_path, problem, consequence, fix, native_bf16(), kernels, tables)


# ---------------------------------------------------------------------------------------------------
# 3. The cache folder
# ---------------------------------------------------------------------------------------------------
def tree_size(path: Path) -> int:
    """Bytes under `path` (links not followed: a link counts as itself)."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(folder) / f).lstat().st_size
            except OSError:  # removed while walking (another process's temporary file)
                pass
    return total


CONVERTED = re.compile(r"^(?P<model>.+)-[0-9a-f]{16}$")  # models/loading.model_cache_dir's folder names


def _describe(root: Path, item: Path, torch_version: str, assembled: dict[str, str]) -> list[CacheEntry]:
    """One or more entries for a top-level item of the cache folder, each with what it is."""
    from specstack.bench.llama_batched import BUILD_DEFAULT
    from specstack.engine.batch_cost import STORE_NAME
    from specstack.throughput.hardware import local_path

    rel = str(item.relative_to(root))
    if item.name == "kernels" and item.is_dir():
        out = []
        for version in sorted(p for p in item.iterdir() if p.is_dir()):
            names = ", ".join(sorted(p.name for p in version.iterdir() if p.is_dir())) or "none"
            stale = "" if version.name == torch_version else " (another torch: unused now, can be deleted)"
            out.append(CacheEntry(str(version.relative_to(root)), tree_size(version),
                                  f"native kernels for torch {version.name}: {names}{stale}"))
        return out
    if item.name == "weights" and item.is_dir():
        return [CacheEntry(str(f.relative_to(root)), f.stat().st_size,
                           f"assembled model{' ' + assembled[f.name] if f.name in assembled else ''}")
                for f in sorted(item.iterdir()) if f.is_file() and f.suffix == ".gguf"]
    if item.name == STORE_NAME:
        return [CacheEntry(rel, tree_size(item), "measured forward costs (the batch cost curves)")]
    if item == local_path().parent:
        return [CacheEntry(rel, tree_size(item), "this machine's throughput-calibrate preset")]
    if item == BUILD_DEFAULT.parents[1]:
        return [CacheEntry(rel, tree_size(item), f"the llama.cpp peers' build ({LLAMA_BUILD})")]
    m = CONVERTED.match(item.name)
    if m and item.is_dir():
        files = sorted(p.name for p in item.glob("*.safetensors"))
        tok = ", tokenizer" if (item / "tokenizer").is_dir() else ""
        return [CacheEntry(rel, tree_size(item),
                           f"converted weights of {m['model']}: {', '.join(files) or 'none'}{tok}")]
    return [CacheEntry(rel, tree_size(item), "other")]


def cache() -> Cache:
    import torch

    from specstack.models.registry import MODELS

    root = cache_root()
    assembled = {m.chunked.file: name for name, m in MODELS.items() if m.chunked is not None}
    entries: list[CacheEntry] = []
    if root.is_dir():
        for item in sorted(root.iterdir()):
            entries += _describe(root, item, torch.__version__, assembled)
    return Cache(str(root), bool(os.environ.get("SPECSTACK_CACHE")), root.is_dir(),
                 tree_size(root) if root.is_dir() else 0, entries)


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


def llama_cmake_args(flags: set[str] | None) -> str:
    """CMAKE_ARGS for a llama-cpp-python that runs on this CPU: the AVX-512 parts only where it has them
    (a binary built for instructions the CPU lacks dies on its first one), AMX always off."""
    isa = [flag for cpu_flag, flag in LLAMA_CMAKE_AVX512 if flags is not None and cpu_flag in flags]
    return " ".join((*LLAMA_CMAKE_BASE, *isa, *LLAMA_CMAKE_AMX_OFF))


def extras(requirements: dict[str, list[Requirement]] | None = None, flags: set[str] | None = None) -> list[Extra]:
    requirements = extra_requirements() if requirements is None else requirements
    out = []
    for name, reqs in requirements.items():
        seen: set[tuple[str, str]] = set()
        missing = [m for r in reqs for m in unmet(r, seen)]
        fix = None
        if missing and any(canonicalize_name(r.name) == "llama-cpp-python" for r in reqs):
            # pip builds llama.cpp from source for this CPU, and its default turns AMX on (a crash on some Xeons)
            fix = (pip_install(name, f'CMAKE_ARGS="{llama_cmake_args(flags)}" ')
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

    folder = model_cache_dir(ModelSource(name, "gguf", gguf))
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


# ---------------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------------
def problems(report: Report) -> tuple[list[Problem], list[str]]:
    """(the problems, with their fixes; the optional pieces that are not installed)."""
    found = []
    c = report.choices
    if c.native_problem and c.native_fix:  # a CPU without AVX2 has nothing to fix: a fact, not a problem
        found.append(Problem("choices", c.native_problem, c.native_fix))
    for t in c.tables:
        if t.error:
            found.append(Problem("choices", t.error, f"unset {t.env} or set it to one of: {', '.join(t.usable)}"))
    for m in report.models:
        if m.default and not m.present and m.fix:
            found.append(Problem("models", f"the default model {m.name} is not installed", m.fix))
    optional = [f"the {e.name} extra" for e in report.extras if not e.installed]
    optional += [b.name for b in report.peer_binaries if b.path is None]
    optional += [m.name for m in report.models if not m.default and not m.present]
    return found, optional


def gather() -> Report:
    """Everything `specstack doctor` prints, read from this machine (nothing built, loaded or written)."""
    report = Report(machine(), choices(), cache(), extras(flags=cpu_flags()), peer_binaries(), models())
    found, optional = problems(report)
    return replace(report, problems=found, optional_missing=optional)


def to_json(report: Report) -> dict[str, Any]:
    """The report as one JSON object: the same fields as the text, plus `ok` and `summary`."""
    return {**asdict(report), "ok": not report.problems, "summary": report.summary()}


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------
def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rows(rows: Iterable[tuple[str, str]], indent: str = "  ") -> list[str]:
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{indent}{k:<{width}}  {v}".rstrip() for k, v in rows]


def _presence(present: bool | None) -> str:
    return "unknown" if present is None else "present" if present else "absent"


def render(report: Report) -> str:
    """The report as plain text, one section each, the summary last."""
    m, c, ca = report.machine, report.choices, report.cache
    lines = ["Machine"]
    cores = f"{m.cores}" + (f" ({m.usable_cores} usable by this process)" if m.usable_cores not in (None, m.cores)
                            else "")
    lines += _rows([("CPU", m.cpu), ("cores", cores),
                    ("torch", f"{m.torch} (CPU capability {m.torch_capability}), {m.torch_threads} threads"),
                    ("python", f"{m.python}, specstack {m.specstack}")])
    lines.append("  instruction sets:")
    lines += _rows(((f.name, f"{_presence(f.present):<8} {f.why}") for f in m.flags), "    ")

    lines += ["", "What specstack chose on this CPU"]
    lines += _rows([("--dtype default", f"{c.default_dtype}: {c.default_dtype_why}"),
                    ("C++ compiler", f"{c.compiler_path or 'not found'}"
                     + (f" (CXX={c.compiler})" if os.environ.get("CXX") is not None else "")),
                    ("ninja", c.ninja_path or "not found"),
                    ("bf16 matmuls", "native" if c.bf16_native else "emulated (wide inputs multiply in fp32)")])
    if c.native_problem:
        lines.append(f"  ! {c.native_problem}: {c.native_consequence}")
        if c.native_fix:
            lines.append(f"    fix: {c.native_fix}")
    lines.append("  native kernels:")
    lines += _rows(((k.name, f"{k.note}  (for {k.used_by})") for k in c.kernels), "    ")
    lines.append("  kernel tables:")
    table_rows = []
    width = max((len(t.chosen or "") for t in c.tables), default=0)
    for t in c.tables:
        forced = f"forced by {t.env}={t.forced}" if t.forced else f"force one with {t.env}={'|'.join(t.entries)}"
        chosen = f"{t.chosen:<{width}}" if t.error is None else f"ERROR: {t.error}"
        table_rows.append((t.name, f"{chosen}  (usable here: {', '.join(t.usable) or 'none'}; {forced})"))
    lines += _rows(table_rows, "    ")

    lines += ["", "Cache folder"]
    where = "SPECSTACK_CACHE" if ca.from_env else "the default; SPECSTACK_CACHE moves it"
    lines.append(f"  {ca.root} ({where}): " + (f"{size(ca.bytes)}" if ca.exists else "not created yet"))
    lines += _rows(((e.path, f"{size(e.bytes):>9}  {e.what}") for e in ca.entries), "    ")

    lines += ["", "Installed extras"]
    width = max((len(e.name) for e in report.extras), default=0)
    for e in report.extras:
        lines.append(f"  {e.name:<{width}}  " + ("installed" if e.installed else f"missing: {', '.join(e.missing)}"))
        if e.fix:
            lines.append(f"  {'':<{width}}  fix: {e.fix}")
    lines.append("  llama.cpp peer binaries:")
    lines += _rows(((b.name, f"found ({b.path})" if b.path else f"not found; for {b.used_by}; build it: {b.fix}")
                    for b in report.peer_binaries), "    ")

    lines += ["", "Models"]
    for md in report.models:
        tag = " (default)" if md.default else ""
        state = f"present, {md.detail}" if md.present else f"missing: {md.detail}"
        lines.append(f"  {md.name}{tag}: {state}")
        if md.path:
            lines.append(f"    {md.path}")
        if md.converted:
            lines.append(f"    converted in the cache: {', '.join(md.converted)}")
        if md.fix:
            lines.append(f"    fix: {md.fix}")

    lines += ["", report.summary()]
    for p in report.problems:
        lines.append(f"  - {p.what}: {p.fix}")
    return "\n".join(lines)
