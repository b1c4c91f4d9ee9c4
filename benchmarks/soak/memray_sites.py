"""Which allocation sites hold more native memory late in a run than early (issue 54), from a capture of
`memray run --native` (memray's temporal records: every allocation's intervals between snapshots).

    memray run --native -o serve.bin -m specstack.cli serve --model smollm2-135m --port 8312 ...
    specstack bench-serve --url http://127.0.0.1:8312/v1 --workload soak --requests 600 ...
    (stop the server with Ctrl-C, so that memray closes the capture)
    python benchmarks/soak/memray_sites.py serve.bin 0.15 0.98 [TOP]

Prints the resident and tracked heap at the two points (fractions of the run's snapshots), then the TOP
sites (default 25) by how much their live bytes grew between them, each with its stack (native frames,
then Python's), and the total.
"""
from __future__ import annotations

import collections
import sys


def live_at(intervals: list, i: int) -> int:
    """Bytes of a site's allocations made before snapshot i and not freed by then."""
    return sum(iv.n_bytes for iv in intervals if iv.allocated_before_snapshot <= i
               and (iv.deallocated_before_snapshot is None or iv.deallocated_before_snapshot > i))


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import memray  # a profiler, not a dependency of specstack: `pip install memray`
    except ImportError:
        print("memray_sites.py needs memray: pip install memray", file=sys.stderr)
        return 2
    reader = memray.FileReader(argv[0])
    top = int(argv[3]) if len(argv) > 3 else 25
    snaps = list(reader.get_memory_snapshots())
    a, b = (int(float(x) * (len(snaps) - 1)) for x in argv[1:3])
    print(f"{len(snaps)} snapshots over {(snaps[-1].time - snaps[0].time) / 1000:.0f} s; RSS {snaps[a].rss >> 20} -> "
          f"{snaps[b].rss >> 20} MB, tracked heap {snaps[a].heap >> 20} -> {snaps[b].heap >> 20} MB")
    growth: collections.Counter[str] = collections.Counter()
    for rec in reader.get_temporal_allocation_records(merge_threads=True):
        stack = rec.hybrid_stack_trace(max_stacks=12)
        site = " <- ".join(f"{fn}@{path.split('/')[-1]}:{line}" for fn, path, line in stack)
        growth[site] += live_at(rec.intervals, b) - live_at(rec.intervals, a)
    for site, n in growth.most_common(top):
        print(f"{n / 2**20:9.2f} MB  {site[:400]}")
    print(f"total growth of live native bytes: {sum(growth.values()) / 2**20:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
