"""Copy a finished `specstack bench` run from bench_out/ into docs/bench/ the way the docs keep runs
(docs/bench-history, top): summary.md, summary.json and run.json; the figures the docs link; and,
with --rows, into a folder outside docs/ (docs/ keeps no rows, so that it stays small to clone:
tests/unit/test_docs_site.py; a claim that needs rows, a `--ratios` or `--phases` table, prompts won,
`throughput-check`, names the command that recomputes it on a fresh run), the rows as results.jsonl.gz
without their per-token arrays (the token ids, their origins, the accepted count per step: four fifths
of a rows file, read by no table). `specstack bench --ratios/--phases` and `specstack throughput-check`
read that file in place of results.jsonl; `specstack bench-ties` needs the token ids, so it runs on
bench_out/ only.

    python benchmarks/publish_run.py bench_out/he164_greedy docs/bench/humaneval164_greedy \
        [--rows] [--figures speedup_per_prompt.png tau_hist.png origins.html]

The gzip file is byte-for-byte the same for the same rows (no time stamp, no name in its header), so
publishing a run again adds nothing to the history unless its rows changed.

    python benchmarks/publish_run.py --tables README.md docs/benchmarks.md [--check]

renders every table those pages mark (`<!-- table {...} -->`, specstack/report/doc_tables.py) again from
the committed runs it names; `--check` changes nothing and fails if a page differs from its rendering.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from specstack.bench.rows import read_rows
from specstack.report.doc_tables import TableError, render_page

KEPT = ("summary.md", "summary.json", "run.json")
PER_TOKEN = ("tokens", "token_origins", "accepted_per_step")  # row fields with one entry per token or step


def packed_rows(src: Path) -> bytes:
    """src/results.jsonl's rows without their per-token arrays, gzip-compressed deterministically."""
    rows = read_rows(src / "results.jsonl")
    if not rows:
        raise SystemExit(f"{src} has no rows (results.jsonl)")
    text = "".join(json.dumps({k: v for k, v in r.items() if k not in PER_TOKEN}) + "\n" for r in rows)
    return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)


ROOT = Path(__file__).resolve().parents[1]


def publish(src: Path, dst: Path, rows: bool, figures: list[str]) -> list[Path]:
    """The files written under dst."""
    if rows and dst.resolve().is_relative_to(ROOT / "docs"):
        raise SystemExit(f"{dst}: docs/ keeps no rows (tests/unit/test_docs_site.py); publish the run without "
                         "--rows and keep its rows in bench_out/, or give a folder outside docs/")
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


def render_tables(pages: list[Path], check: bool) -> list[Path]:
    """The pages whose tables differ from their rendering (rewritten unless `check`)."""
    stale = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        try:
            rendered = render_page(text, ROOT, page.resolve().parent)
        except TableError as e:
            raise SystemExit(f"{page}: {e}") from None
        if rendered != text:
            stale.append(page)
            if not check:
                page.write_text(rendered, encoding="utf-8")
    return stale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, nargs="?", help="a finished `specstack bench` output folder (bench_out/...)")
    p.add_argument("dst", type=Path, nargs="?", help="its folder under docs/bench")
    p.add_argument("--rows", action="store_true", help="also results.jsonl.gz, the rows without per-token arrays")
    p.add_argument("--figures", nargs="*", default=[], help="files of the run the docs link (png, html)")
    p.add_argument("--tables", nargs="+", type=Path, metavar="PAGE", help="render the tables these pages mark")
    p.add_argument("--check", action="store_true", help="with --tables: change nothing, fail if a page is stale")
    args = p.parse_args()
    if args.tables:
        stale = render_tables(args.tables, args.check)
        for page in stale:
            print(f"{page}: {'differs from its runs' if args.check else 'tables rendered again'}")
        raise SystemExit(1 if stale and args.check else 0)
    if args.src is None or args.dst is None:
        p.error("give SRC and DST, or --tables PAGE...")
    for path in publish(args.src, args.dst, args.rows, args.figures):
        print(f"{path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
