"""The machine, what specstack chose on it (the kernel tables asked inside `native.planning()`: nothing
is built) and the cache folder: sections 1-3 of the report."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstack.bench.llama_build import SCRIPT as LLAMA_BUILD
from specstack.errors import SpecstackError
from specstack.files import cache_root
from specstack.machine import cpu_flags, cpu_model, package_version

if TYPE_CHECKING:
    from specstack.models.kernel_table import KernelChoice

from specstack.doctor.report import Cache, CacheEntry, Choices, CpuFlag, KernelTable, Machine, NativeKernel

# The instruction sets that decide something here, and what (the kernels' own docstrings say more:
# models/native.py, models/w4a8.py, models/linear_methods.native_bf16)
CPU_FLAGS: tuple[tuple[str, str], ...] = (
    ("avx2", "every native kernel needs it; without it the default format is int4"),
    ("avx512f", "torch's AVX512 code; with avx512_vnni, w4a8's fastest paths"),
    ("avx512_vnni", "w4a8's wide512 and vnni512 paths (vpdpbusd on 512-bit vectors)"),
    ("avx512_bf16", "bf16 dot products in hardware (bf16 models, int4/int8 wide inputs)"),
    ("amx_tile", "with amx_int8: w4a8's amx path (tile products for calls of many rows); llama.cpp peers are "
                 "built with AMX off (theirs crashes on some Xeons)"),
    ("amx_int8", "as amx_tile"),
    ("avx_vnni", "256-bit VNNI: unused (specstack's VNNI paths are 512-bit)"),
)
# what each native kernel (models/kernels/<name>.cpp) is for
KERNEL_USES: dict[str, str] = {
    "w4a8": "w4a8's avx2 and vnni512 paths, and the default format w4a8",
    "w4a8_wide": "w4a8's wide512 and amx paths",
    "attention": "the fixed-order attention of the batch-invariant formats",
    "layer": "the native decoder: a forward's blocks in one call",
}
BUILD_TIME = "~15 s"  # a kernel's first build, roughly (native.load prints the real time when it builds one)
FIRST_BUILD = f"built on first use, {BUILD_TIME}"
COMPILER_FIX = "apt install g++ (or set CXX to a C++ compiler)"
NINJA_FIX = "pip install ninja"


# ---------------------------------------------------------------------------------------------------
# 1. The machine
# ---------------------------------------------------------------------------------------------------
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
    from specstack.models import fixed_attention, huge_pages, native, w4a8, w8a8
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
    return Choices(fmt, why, cxx, cxx_path, ninja_path, problem, consequence, fix, native_bf16(), huge_pages.describe(),
                   kernels, tables)


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


def _describe(root: Path, item: Path, torch_version: str, assembled: dict[str, str]) -> list[CacheEntry]:
    """One or more entries for a top-level item of the cache folder, each with what it is."""
    from specstack.bench.llama_batched import BUILD_DEFAULT
    from specstack.engine.batch_cost import STORE_NAME
    from specstack.models import model_cache
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
    m = model_cache.FOLDER.match(item.name)
    if m and item.is_dir():
        files = sorted(p.name for p in item.glob("*.safetensors"))
        tok = ", tokenizer" if (item / "tokenizer").is_dir() else ""
        gone = " (its source is gone: removed when a model is next converted, or delete it)" \
            if model_cache.stale(item) else ""
        return [CacheEntry(rel, tree_size(item),
                           f"converted weights of {m['model']}: {', '.join(files) or 'none'}{tok}{gone}")]
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
