"""How llama.cpp is built for this CPU, written once: the CMake flags that benchmarks/build_llama_cpp.sh
passes to its binaries and that a llama-cpp-python (the `peers` extra) must be built with.

Native detection stays off: on some of our Xeons it turns AMX on and the first `decode` ends in a
segmentation fault. Each instruction set is named instead, the AVX-512 parts only where this CPU has
them (a binary built for instructions the CPU lacks dies on its first one), AMX always off.

    python -m specstack.bench.llama_build      # prints this CPU's flags (the build script reads them)
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from specstack.machine import cpu_flags

SCRIPT = "benchmarks/build_llama_cpp.sh"
BASE = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
# (the CPU's flag in /proc/cpuinfo, the CMake flag it allows)
AVX512 = (("avx512f", "-DGGML_AVX512=ON"), ("avx512_vnni", "-DGGML_AVX512_VNNI=ON"),
          ("avx512_bf16", "-DGGML_AVX512_BF16=ON"))
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cmake_flags(flags: set[str] | None) -> tuple[str, ...]:
    """The GGML flags for a CPU with these /proc/cpuinfo flags (None: unknown, the AVX2 baseline only).
    AVX-512's extensions go with its foundation only: a CPU listing avx512_vnni without avx512f gets neither."""
    have = flags or set()
    isa = [flag for cpu_flag, flag in AVX512 if cpu_flag in have and "avx512f" in have]
    return (*BASE, *isa, *AMX_OFF)


def cmake_args(flags: set[str] | None = None) -> str:
    """CMAKE_ARGS for this CPU (its /proc/cpuinfo flags unless given)."""
    return " ".join(cmake_flags(cpu_flags() if flags is None else flags))


def rebuild_llama_cpp_python() -> str:
    """The command that rebuilds llama-cpp-python for this CPU, from source, with these flags."""
    return (f'CMAKE_ARGS="{cmake_args()}" pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python '
            "llama-cpp-python")


def binary_about(binary: Path) -> str:
    """What a llama.cpp program is: its path, the version it prints, and the instruction-set flags its
    build was configured with (the CMakeCache.txt above its bin/ folder, where the build script leaves it)."""
    try:
        run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        version = next((line.strip() for line in (run.stdout + run.stderr).splitlines()
                        if line.startswith("version")), "version unknown")
    except (OSError, subprocess.SubprocessError):
        version = "version unknown"
    cache = binary.resolve().parent.parent / "CMakeCache.txt"
    flags = []
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            name = key.split(":")[0]
            if name.startswith("GGML_") and name[5:].split("_")[0] in BUILD_KEYS:
                flags.append(f"{name}={value}")
    return f"{binary} ({version}; {' '.join(flags) if flags else 'build flags unknown'})"


# the parts of a build's CMake cache a report names: the native switch and the instruction sets
BUILD_KEYS = ("NATIVE", "AVX", "AVX2", "AVX512", "FMA", "F16C", "AMX")


if __name__ == "__main__":
    print(cmake_args())
