"""Several soaks (`specstack bench-serve --workload soak`, soak.json each) in one figure and one table:
the server's memory against requests for each, so that a cache's cost is the gap between a run with it
and one without on the same machine.

    python benchmarks/soak/compare.py OUT.png NAME=RUN_DIR [NAME=RUN_DIR ...]

Prints the verdict table (markdown, one row per run) and writes OUT.png.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specstack.bench.serve_soak_report import plot_soaks, verdict_table


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    runs = {name: json.loads((Path(d) / "soak.json").read_text()) for name, d in (a.split("=", 1) for a in argv[1:])}
    rows = [verdict_table(doc["verdict"], name).splitlines() for name, doc in runs.items()]
    print("\n".join(rows[0][:2] + [r[2] for r in rows]))
    plot_soaks(runs, Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
