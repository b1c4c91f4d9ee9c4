"""How llama.cpp is built for a CPU (bench/llama_build.py), the one place the build script, the doctor and
a crashing peer's hint read it from: each instruction set from the CPU's own flags, AMX never on; and what
a built binary says of itself in a report."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specstack.bench.llama_build import AMX_OFF, BASE, binary_about, cmake_args, cmake_flags

ZEN4 = set("fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi".split())
AVX2_ONLY = set("fpu sse2 avx avx2 fma f16c".split())
XEON_AMX = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("flags,avx512", [
    (AVX2_ONLY, []),
    (ZEN4, ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"]),
    (XEON_AMX, ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"]),
    (ZEN4 - {"avx512_bf16"}, ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"]),
    (AVX2_ONLY | {"avx512_vnni"}, []),  # an extension without AVX-512's foundation enables nothing
    (None, []),  # unknown CPU: the AVX2 baseline
])
def test_flags_follow_the_cpu_and_amx_is_always_off(flags, avx512):
    got = cmake_flags(flags)
    assert got[:len(BASE)] == BASE and got[-len(AMX_OFF):] == AMX_OFF
    assert list(got[len(BASE):-len(AMX_OFF)]) == avx512
    assert not any("AMX" in f and f.endswith("=ON") for f in got)
    assert cmake_args(flags or set()) == " ".join(got)


def test_the_build_script_reads_its_flags_from_here():
    """benchmarks/build_llama_cpp.sh configures with what `python -m specstack.bench.llama_build` prints
    (this machine's flags), not flags of its own."""
    root = Path(__file__).resolve().parents[2]
    script = (root / "benchmarks" / "build_llama_cpp.sh").read_text()
    assert "python3 -m specstack.bench.llama_build" in script and "-DGGML_AVX2" not in script
    printed = subprocess.run(["python3", "-m", "specstack.bench.llama_build"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
    assert printed == cmake_args()


def test_a_binary_says_its_version_and_build_flags(tmp_path):
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    binary = build / "bin" / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 7001 (abc123)' >&2\necho 'built with cc' >&2\n")
    binary.chmod(0o755)
    (build / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AMX_INT8:BOOL=OFF\n"
                                          "GGML_CUDA:BOOL=OFF\nCMAKE_BUILD_TYPE:STRING=Release\n")
    about = binary_about(binary)
    assert about == f"{binary} (version: 7001 (abc123); GGML_NATIVE=OFF GGML_AVX2=ON GGML_AMX_INT8=OFF)"
    (build / "CMakeCache.txt").unlink()
    assert "build flags unknown" in binary_about(binary)
