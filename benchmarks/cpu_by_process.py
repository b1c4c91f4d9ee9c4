"""CPU time by process while a command runs: where a machine's cores went during a load (issue 22:
the replicas against Ray's own processes and the proxy, on the same two cores).

Reads every process's user+system time from /proc before and after `COMMAND` (a load generator, say),
and prints each command line's CPU seconds and share of one core over the wall time, most first.
Processes that ended during the run are not counted (the command itself among them).

    python benchmarks/cpu_by_process.py specstack bench-serve --url http://127.0.0.1:8000/v1 --concurrency 8 ...
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

MIN_SECONDS = 0.2  # processes that used less are left out


def cpu_times() -> dict[str, tuple[int, str]]:
    """pid -> (user + system clock ticks, its command line, shortened)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
        except OSError:  # ended meanwhile
            continue
        out[pid] = (int(fields[11]) + int(fields[12]), cmd)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    before, t0 = cpu_times(), time.monotonic()
    code = subprocess.run(argv, stdout=subprocess.DEVNULL).returncode
    after, wall = cpu_times(), time.monotonic() - t0
    tick = os.sysconf("SC_CLK_TCK")
    by_command: collections.Counter[str] = collections.Counter()
    for pid, (ticks, cmd) in after.items():
        seconds = (ticks - before.get(pid, (0, ""))[0]) / tick
        if seconds > MIN_SECONDS:
            by_command[cmd or f"[pid {pid}]"] += seconds
    print(f"wall {wall:.1f} s, command exit status {code}")
    for cmd, seconds in by_command.most_common(15):
        print(f"{seconds:7.1f} s  {seconds / wall * 100:5.1f} % of a core  {cmd}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
