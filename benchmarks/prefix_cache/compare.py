"""The servers of one benchmarks/prefix_cache/run.sh run side by side: for each workload, one table with a
row block per server (the tables of `specstack bench-serve --workload ...`, a server column first), then
the numbers issue 33 asks about in one short list. Reads OUT_DIR/SERVER/WORKLOAD/WORKLOAD.json, writes
OUT_DIR/summary.md and prints it.

    python benchmarks/prefix_cache/compare.py OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specstack.bench.serve_workload_report import TABLES
from specstack.files import atomic_write_text

WORKLOADS = ("chat", "editor", "prefix-probe")


def runs(out: Path, workload: str) -> list[dict[str, Any]]:
    """Every server's run of `workload` under `out`, in the order run.sh ran them (its servers.txt), else by name."""
    order_file = out / "servers.txt"
    order = order_file.read_text().split() if order_file.is_file() else []
    paths = sorted(out.glob(f"*/{workload}/{workload}.json"),
                   key=lambda p: (order.index(p.parts[-3]) if p.parts[-3] in order else len(order), p.parts[-3]))
    return [json.loads(p.read_text()) for p in paths]


def merged_table(docs: list[dict[str, Any]], workload: str) -> str:
    """One table: the first server's header, then every server's rows."""
    lines: list[str] = []
    for doc in docs:
        table = TABLES[workload](doc["summary"], doc["label"]).splitlines()
        lines += table if not lines else table[2:]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f} ms"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def headline(workload: str, doc: dict[str, Any]) -> str:
    s = doc["summary"]
    if workload == "chat":
        last = s["turns"][-1]
        return (f"chat: TTFT p50 turn 1 {_ms(s['turns'][0]['ttft_ms_p50'])}, turn {last['turn']} "
                f"{_ms(last['ttft_ms_p50'])}, all {_ms(s['total']['ttft_ms_p50'])}; wall {s['wall_s']:.1f} s")
    if workload == "editor":
        return (f"editor: TTFT p50 {_ms(s['rest']['ttft_ms_p50'])} after the first ({_ms(s['first']['ttft_ms_p50'])}), "
                f"latency p50 {_ms(s['rest']['latency_ms_p50'])}")
    m = s["median"]
    return (f"prefix-probe: +tail / cold {_x(m['extended_over_cold'])} ({_ms(m['extended_ttft_ms'])} / "
            f"{_ms(m['cold_ttft_ms'])}), n=N / n=1 {_x(m['nN_over_n1'])} ({_ms(m['nN_ttft_ms'])} / {_ms(m['n1_ttft_ms'])})")


def render(out: Path) -> str:
    lines = [f"# Prefix cache: {out.name}", ""]
    notes = out / "notes.txt"
    if notes.is_file() and notes.read_text().strip():
        lines += [f"- {n}" for n in notes.read_text().strip().splitlines()] + [""]
    labels: dict[str, list[str]] = {}
    for workload in WORKLOADS:
        docs = runs(out, workload)
        if not docs:
            continue
        lines += [f"## {workload}", "", f"`{docs[0]['command']}`", "", merged_table(docs, workload), ""]
        for doc in docs:
            labels.setdefault(doc["label"], []).append(headline(workload, doc))
    if labels:
        lines += ["## In short", ""]
        for label, items in labels.items():
            lines += [f"- **{label}**: " + "; ".join(items)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="run.sh's OUT_DIR")
    args = ap.parse_args()
    text = render(args.out)
    atomic_write_text(args.out / "summary.md", text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
