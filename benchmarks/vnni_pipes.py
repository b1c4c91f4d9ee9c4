"""What this core's `vpdpbusd` (512-bit) costs, and which other instructions compete with it: the bound of
the wide512 kernel's products (models/kernels/w4a8_wide.cpp). Small C loops of inline assembly, compiled
with the system's gcc and run on one core: 16 independent chains (the throughput), one chain (the
latency), then 8 chains beside 4 of another instruction each iteration: an instruction that shares the
products' pipes slows them, one that runs elsewhere does not. G vpdpbusd a second and cycles per 8
(at the clock the caller gives, from the one-chain latency otherwise unknowable here).

    python benchmarks/vnni_pipes.py [--ghz 4.2]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# beside the products: a name and the instruction (AT&T operands; {d} a scratch register's number)
OTHERS = {
    "nothing": "",
    "vcvtdq2ps": "vcvtdq2ps %%zmm20,%%zmm{d}",
    "vmulps": "vmulps %%zmm20,%%zmm22,%%zmm{d}",
    "vfmadd231ps": "vfmadd231ps %%zmm20,%%zmm22,%%zmm{d}",
    "vaddps": "vaddps %%zmm20,%%zmm22,%%zmm{d}",
    "vpmulld": "vpmulld %%zmm20,%%zmm22,%%zmm{d}",
    "vpaddd": "vpaddd %%zmm20,%%zmm22,%%zmm{d}",
    "vpandd": "vpandd %%zmm20,%%zmm22,%%zmm{d}",
    "vpsrlw": "vpsrlw $4,%%zmm20,%%zmm{d}",
    "vpternlogd": "vpternlogd $0xF8,%%zmm20,%%zmm22,%%zmm{d}",
    "vpbroadcastd (load)": "vpbroadcastd (%0),%%zmm{d}",
}

PROGRAM = r"""#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int buf[64] __attribute__((aligned(64)));
int main(void) {
  const long n = 50000000; int* p = buf; double t0 = now();
  for (long r = 0; r < n; r++) {
    __asm__ volatile(BODY :: "r"(p) : CLOBBERS);
  }
  printf("%.3f\n", n * (double)PRODUCTS / (now() - t0) / 1e9);
  return 0;
}
"""


def products(chains: int, same: bool = False) -> str:
    """`chains` vpdpbusd into zmm0.. (independent), or all into zmm0 (one chain)."""
    return "".join(f'"vpdpbusd %%zmm30,%%zmm31,%%zmm{0 if same else i}\\n"' for i in range(chains))


def run(body: str, count: int, clobbers: list[int], folder: Path) -> float:
    src = PROGRAM.replace("BODY", body).replace("PRODUCTS", str(count))
    src = src.replace("CLOBBERS", ", ".join(f'"xmm{r}"' for r in clobbers))
    (folder / "probe.c").write_text(src)
    subprocess.run(["gcc", "-O2", "-mavx512f", "-o", str(folder / "probe"), str(folder / "probe.c")], check=True)
    return float(subprocess.run([str(folder / "probe")], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ghz", type=float, default=None, help="the core's clock, to print cycles (default: none)")
    a = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "avx512_vnni" not in flags:
        sys.exit("vnni_pipes: this CPU has no AVX-512-VNNI (nothing to measure)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        peak = run(products(16), 16, list(range(16)), folder)
        chain = run(products(8, same=True), 8, [0], folder)
        print(f"16 chains: {peak:.2f} G vpdpbusd/s; one chain: {chain:.2f} G/s")
        for name, op in OTHERS.items():
            body = products(8) + "".join(f'"{op.format(d=8 + i)}\\n"' for i in range(4) if op)
            rate = run(body, 8, list(range(12)), folder)
            cycles = f", {8 * a.ghz / rate:.2f} cycles per 8" if a.ghz else ""
            print(f"8 chains + 4 {name}: {rate:.2f} G vpdpbusd/s{cycles}", flush=True)


if __name__ == "__main__":
    main()
