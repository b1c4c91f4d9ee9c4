"""Kernels of our own, compiled from the C++ in models/kernels/ on the machine that runs them.

Built at first use (torch's extension builder, ninja and the system's C++ compiler), once per machine:
the build is kept in SPECSTACK_CACHE/kernels/<torch version>/ and reused by every later process, and
rebuilt only when the source changes. The first build takes tens of seconds and says so on stderr.
Nothing is downloaded: the source ships with specstack, the compiler is the machine's.

A kernel is built only where the CPU reports the instructions it is compiled for (`CPU_FLAGS`); a
failed build is reported once and the caller falls back to its reference path.
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import time
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
LDFLAGS = ("-fopenmp",)
_LOADED: set[str] = set()  # kernels whose ops this process has registered (a library registers once)


def cpu_capability() -> str:
    """What torch's CPU dispatcher found this CPU to support: DEFAULT, AVX2, AVX512, ..."""
    return torch.backends.cpu.get_cpu_capability()


def has_vnni512() -> bool:
    """Whether this CPU has AVX-512 with VNNI (vpdpbusd on 512-bit vectors): Intel Ice Lake and later,
    AMD Zen 4 and later. The kernels' VNNI functions are compiled for that target on their own."""
    return cpu_capability() == "AVX512" and bool(torch.cpu._is_vnni_supported())


def supported(name: str) -> bool:
    """Whether this CPU runs kernel `name` and a compiler is there to build it."""
    return cpu_capability() in CPU_FLAGS[name] and shutil.which("c++") is not None


def _headers_flag() -> str:
    """A define whose value is the hash of kernels/*.h: torch's builder rebuilds a library when its
    source or flags change, not when a header it includes does, so the header's content is a flag."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCES.glob("*.h")))).hexdigest()[:16]
    return f"-DSPECSTACK_HEADERS={digest}"


@functools.cache
def load(name: str) -> bool:
    """Build (or reuse) kernel `name` and register its torch ops; False when it cannot be had here."""
    if not supported(name):
        return False
    if name in _LOADED:  # another cache folder since (SPECSTACK_CACHE changed): its ops are here already
        return True
    from torch.utils import cpp_extension

    build = cache_root() / "kernels" / torch.__version__ / name
    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    if fresh:
        print(f"specstack: building the {name} kernel for this machine (once; it is kept in {build})...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        cpp_extension.load(name=f"specstack_{name}", sources=[str(SOURCES / f"{name}.cpp")],
                           extra_cflags=[*CFLAGS, _headers_flag()], extra_ldflags=list(LDFLAGS), build_directory=str(build),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no ninja, a compiler error, a failed link
        print(f"specstack: the {name} kernel could not be built ({str(e).splitlines()[0][:200]}); "
              "using the slow reference path", file=sys.stderr, flush=True)
        return False
    if fresh:
        print(f"specstack: built the {name} kernel in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    _LOADED.add(name)
    return True
