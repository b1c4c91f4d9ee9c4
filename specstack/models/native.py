"""Kernels of our own, compiled from the C++ in models/kernels/ on the machine that runs them.

Built at first use (torch's extension builder, ninja and the system's C++ compiler), once per machine:
the build is kept in SPECSTACK_CACHE/kernels/<torch version>/ and reused by every later process, and
rebuilt only when the source changes. The first build takes tens of seconds and says so on stderr.
Nothing is downloaded: the source ships with specstack, the compiler is the machine's. Processes build
or check a kernel's folder one at a time (`build_lock`, a lock that dies with its holder), so a build
killed midway never leaves a later one waiting, and one that waits for another's build says so.

A kernel is built only where the CPU reports the instructions it is compiled for (`CPU_FLAGS`); a
failed build is reported once and the caller falls back to its reference path.

The kernel tables ask for a kernel through `available`, which is `load` except inside `planning()`: there
it answers whether `load` would succeed and builds nothing, so `specstack doctor` can say what a run
would choose without compiling for tens of seconds or writing to the cache.
"""
from __future__ import annotations

import contextvars
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from specstack.files import cache_root

SOURCES = Path(__file__).parent / "kernels"
# the instructions each kernel is compiled for, as torch names the CPU's capability
CPU_FLAGS: dict[str, tuple[str, ...]] = {"w4a8": ("AVX2", "AVX512"), "attention": ("AVX2", "AVX512"),
                                      "layer": ("AVX2", "AVX512"), "w4a8_wide": ("AVX512",)}
# -fopenmp: at::parallel_for is inlined from ATen's headers and runs on one thread without it; the
# library then asks for libgomp.so.1, which resolves to the copy torch has already loaded (one pool)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp", "-Wl,-z,now")  # every symbol bound at load: see kernels/w4a8_amx.h
_LOADED: set[str] = set()  # kernels whose ops this process has registered (a library registers once)
# inside `planning()`: `available` predicts instead of building (a context variable, so a planning thread
# never changes what another thread's tables get)
_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("specstack_native_planning", default=False)


def cpu_capability() -> str:
    """What torch's CPU dispatcher found this CPU to support: DEFAULT, AVX2, AVX512, ..."""
    return torch.backends.cpu.get_cpu_capability()


def has_vnni512() -> bool:
    """Whether this CPU has AVX-512 with VNNI (vpdpbusd on 512-bit vectors): Intel Ice Lake and later,
    AMD Zen 4 and later. The kernels' VNNI functions are compiled for that target on their own."""
    return cpu_capability() == "AVX512" and bool(torch.cpu._is_vnni_supported())


@functools.cache
def has_amx() -> bool:
    """Whether this process may run AMX-INT8 tile instructions: AVX-512 with VNNI (the wide layout's
    tiles), the CPU's AMX tile and int8 flags, and the kernel's grant of the tiles' state to this process
    (Linux asks for it: arch_prctl(ARCH_REQ_XCOMP_PERM), which torch.cpu._init_amx makes). A CPU with AMX
    whose kernel refuses it is said once on stderr, and the process runs without AMX."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if not (has_vnni512() and caps.get("amx_tile") and caps.get("amx_int8")):
        return False
    if torch.cpu._init_amx():
        return True
    print("specstack: this CPU has AMX but the kernel did not grant it to this process; "
          "w4a8 runs without it", file=sys.stderr, flush=True)
    return False


def compiler() -> tuple[str, str | None]:
    """(the C++ compiler torch's extension builder runs, its path or None when it is not there): $CXX,
    else `c++`, looked up on PATH as torch.utils.cpp_extension looks it up."""
    name = os.environ.get("CXX", "c++")
    return name, shutil.which(name) if name else None


def ninja() -> str | None:
    """The path of ninja, which torch's builder runs for every load, a build or not (None: not there)."""
    return shutil.which("ninja")


def supported(name: str) -> bool:
    """Whether this CPU runs kernel `name` and a compiler is there to build it."""
    return cpu_capability() in CPU_FLAGS[name] and compiler()[1] is not None


def build_dir(name: str) -> Path:
    """Where kernel `name` is built and kept for this torch (SPECSTACK_CACHE/kernels/<torch version>/name)."""
    return cache_root() / "kernels" / torch.__version__ / name


def built(name: str) -> Path | None:
    """The library of kernel `name` in the cache, if a build left one (read only: nothing is built)."""
    return next(iter(sorted(build_dir(name).glob("*.so"))), None)


def sources(name: str) -> list[Path]:
    """The files kernel `name` is compiled from: its .cpp and the shared headers."""
    return [SOURCES / f"{name}.cpp", *sorted(SOURCES.glob("*.h"))]


def out_of_date(name: str) -> bool:
    """Whether the next `load` rebuilds kernel `name` (read only): a source newer than its library (ninja
    compares the same times), or headers whose hash is not the one it was built with (torch rewrites the
    build file when a flag changes, and the headers' hash is one: `_headers_flag`)."""
    library = built(name)
    if library is None:
        return True
    at = library.stat().st_mtime
    if any(p.is_file() and p.stat().st_mtime > at for p in sources(name)):
        return True
    try:
        return _headers_flag() not in (build_dir(name) / "build.ninja").read_text()
    except OSError:  # no build file: torch's builder writes one, and builds
        return True


@contextmanager
def planning() -> Iterator[None]:
    """Within it, `available` says whether a kernel would load and builds nothing (`specstack doctor`)."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def available(name: str) -> bool:
    """Whether kernel `name` can be used in this process: `load` (built on first use), except inside
    `planning()`, where it is whether `load` would succeed: loaded already, or the CPU, the compiler and
    ninja are there (a build that would fail for another reason is not foreseen)."""
    if _PLANNING.get():
        return name in _LOADED or (supported(name) and ninja() is not None)
    return load(name)


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source (models/kernels/): part of the key of a measured forward cost
    (engine/batch_cost.py), so that a change to the code that runs a forward retires what was measured
    with the old code."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.is_file())).hexdigest()[:16]


def _headers_flag() -> str:
    """A define whose value is the hash of kernels/*.h: torch's builder rebuilds a library when its
    source or flags change, not when a header it includes does, so the header's content is a flag."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCES.glob("*.h")))).hexdigest()[:16]
    return f"-DSPECSTACK_HEADERS={digest}"


@contextmanager
def build_lock(build: Path, name: str) -> Iterator[None]:
    """One process at a time builds or checks a kernel's folder, under a lock the operating system drops
    when its holder dies. torch's builder keeps its own lock as a file in the folder (`lock`), which a process
    killed while building (a signal, the OOM killer, a stopped service) leaves behind, and every later load
    would wait on it forever without a word; under this lock no live process holds that file, so one found
    is removed."""
    with open(build / "specstack.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"specstack: waiting for another process building the {name} kernel ({build})...",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)  # torch's baton, left by a build that was killed
        yield  # the lock goes with the file's closing


@functools.cache
def load(name: str) -> bool:
    """Build (or reuse) kernel `name` and register its torch ops; False when it cannot be had here."""
    if not supported(name):
        return False
    if name in _LOADED:  # another cache folder since (SPECSTACK_CACHE changed): its ops are here already
        return True
    from torch.utils import cpp_extension

    build = build_dir(name)
    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    if fresh:
        print(f"specstack: building the {name} kernel for this machine (once; it is kept in {build})...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with build_lock(build, name):
            cpp_extension.load(name=f"specstack_{name}", sources=[str(SOURCES / f"{name}.cpp")],
                               extra_cflags=[*CFLAGS, _headers_flag()], extra_ldflags=list(LDFLAGS),
                               build_directory=str(build), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no ninja, a compiler error, a failed link
        print(f"specstack: the {name} kernel could not be built ({str(e).splitlines()[0][:200]}); "
              "using the slow reference path", file=sys.stderr, flush=True)
        return False
    if fresh:
        print(f"specstack: built the {name} kernel in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    _LOADED.add(name)
    return True
