"""Copy a finished `specstack bench` run from bench_out/ into docs/bench/ the way the docs keep runs
(docs/BENCHMARKS.md, top): summary.md, summary.json and run.json; the figures the docs link; and,
where a claim needs more than the summary (a `--ratios` or `--phases` table, prompts won,
`throughput-check`), the rows as results.jsonl.gz without their per-token arrays (the token ids,
their origins, the accepted count per step: four fifths of a rows file, read by no table).
`specstack bench --ratios/--phases` and `specstack throughput-check` read that file in place of
results.jsonl; `specstack bench-ties` needs the token ids, so it runs on bench_out/ only.

    python benchmarks/publish_run.py bench_out/he164_greedy docs/bench/humaneval164_greedy \
        [--rows] [--figures speedup_per_prompt.png tau_hist.png origins.html]

The gzip file is byte-for-byte the same for the same rows (no time stamp, no name in its header), so
publishing a run again adds nothing to the history unless its rows changed.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from specstack.bench.rows import read_rows

KEPT = ("summary.md", "summary.json", "run.json")
PER_TOKEN = ("tokens", "token_origins", "accepted_per_step")  # row fields with one entry per token or step


def packed_rows(src: Path) -> bytes:
    """src/results.jsonl's rows without their per-token arrays, gzip-compressed deterministically."""
    rows = read_rows(src / "results.jsonl")
    if not rows:
        raise SystemExit(f"{src} has no rows (results.jsonl)")
    text = "".join(json.dumps({k: v for k, v in r.items() if k not in PER_TOKEN}) + "\n" for r in rows)
    return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)


def publish(src: Path, dst: Path, rows: bool, figures: list[str]) -> list[Path]:
    """The files written under dst."""
    if not (src / "summary.json").is_file():
        raise SystemExit(f"{src} is not a finished `specstack bench` run (no summary.json)")
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    for name in [*KEPT, *figures]:
        if (src / name).is_file():
            if (src / name).resolve() != (dst / name).resolve():
                shutil.copyfile(src / name, dst / name)
            written.append(dst / name)
        elif name in figures:
            raise SystemExit(f"{src} has no {name}")
    if rows:
        (dst / "results.jsonl.gz").write_bytes(packed_rows(src))
        written.append(dst / "results.jsonl.gz")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="a finished `specstack bench` output folder (bench_out/...)")
    p.add_argument("dst", type=Path, help="its folder under docs/bench")
    p.add_argument("--rows", action="store_true", help="also results.jsonl.gz, the rows without per-token arrays")
    p.add_argument("--figures", nargs="*", default=[], help="files of the run the docs link (png, html)")
    args = p.parse_args()
    for path in publish(args.src, args.dst, args.rows, args.figures):
        print(f"{path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
