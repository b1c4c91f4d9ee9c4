"""Tables of the docs rendered from committed runs, so no figure on the front pages is typed by hand.

A page marks a table with a JSON spec in an HTML comment, and the lines up to `<!-- /table -->` are
what `render_page` writes there:

    <!-- table {"from": {"code": "docs/bench/wide512_pair/summary.md"},
                "rows": [["ar", "`ar`"], ["llamacpp", "llama.cpp"]],
                "cols": [["method", "method"], ["code:tokens/s", "tokens/s"],
                         ["code:tokens/s/llamacpp", "× llama.cpp"]]} -->
    | method | tokens/s | × llama.cpp |
    ...
    <!-- /table -->

`from` names each source: a markdown file a run wrote (its first table, or the first under the heading
after `#`). `key` (default: the first column) names the column(s) that identify a row; `rows` picks rows
by key, each with the name the page shows. A column is `method` (the row's shown name), `SRC:COLUMN`
(the cell as the run wrote it) or `SRC:COLUMN/ROW` (this row's value over row ROW's in the same
column, two decimals: the ratios in one run that the docs compare; `SRC:COLUMN/@base` takes ROW from the
row's own third element, `["auto@b4", "auto", "ar@b4"]`). A row's third element may instead be
`{"base": ROW, "from": SRC}`, and a column `*:COLUMN` then reads that row's SRC: one table of rows from
several runs (one soak a row). A row a source lacks shows `–`.
`python benchmarks/publish_run.py --tables README.md docs/benchmarks.md` rewrites every marked table;
a test checks that the committed pages equal what this renders.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

START = re.compile(r"<!-- table (\{.*?\}) -->\n", re.DOTALL)
END = "<!-- /table -->"
MISSING = "–"


class TableError(ValueError):
    """A spec that names what its run does not have: the page cannot be rendered."""


@dataclass(frozen=True)
class RunTable:
    header: list[str]
    rows: dict[str, list[str]]  # key -> cells

    def cell(self, key: str, column: str) -> str | None:
        if column not in self.header:
            raise TableError(f"no column {column!r} (has: {', '.join(self.header)})")
        row = self.rows.get(key)
        return None if row is None else row[self.header.index(column)]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_table(path: Path, heading: str | None, key: list[str] | None) -> RunTable:
    """The first markdown table in `path` (after the line `heading` where one is given)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = 0
    if heading is not None:
        found = [i for i, line in enumerate(lines) if line.lstrip("#").strip() == heading]
        if not found:
            raise TableError(f"{path}: no heading {heading!r}")
        start = found[0]
    for i in range(start, len(lines) - 1):
        if lines[i].startswith("|") and re.fullmatch(r"\|[\s:|-]+\|?", lines[i + 1].strip()):
            header = _cells(lines[i])
            keys = key or header[:1]
            for k in keys:
                if k not in header:
                    raise TableError(f"{path}: no key column {k!r}")
            rows: dict[str, list[str]] = {}
            for line in lines[i + 2:]:
                if not line.startswith("|"):
                    break
                cells = _cells(line)
                rows.setdefault(" | ".join(cells[header.index(k)] for k in keys), cells)
            return RunTable(header, rows)
    raise TableError(f"{path}: no table" + (f" under {heading!r}" if heading else ""))


def number(cell: str) -> float:
    """A cell's number: `**63.3**`, `1,024`, `100 %` and `1.46 x` read as numbers."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
    if m is None:
        raise TableError(f"not a number: {cell!r}")
    return float(m.group(0).replace(",", ""))


def render_table(spec: dict, root: Path, page_dir: Path) -> str:
    sources = {}
    for name, ref in spec["from"].items():
        file, _, heading = ref.partition("#")
        if not (root / file).is_file():
            raise TableError(f"source {name}: {file} does not exist")
        sources[name] = (file, read_table(root / file, heading or None, spec.get("key")))
    heads = [head for _, head in spec["cols"]]
    out = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(heads))) + "|"]
    for key, shown, *extra in spec["rows"]:
        row = extra[0] if extra and isinstance(extra[0], dict) else {"base": extra[0]} if extra else {}
        cells = []
        for expr, _ in spec["cols"]:
            if expr == "method":
                cells.append(shown)
                continue
            src, _, col = expr.partition(":")
            src = row.get("from", src) if src == "*" else src
            if src not in sources:
                raise TableError(f"column {expr!r}: no source {src!r}" + (f" (row {key!r})" if expr.startswith("*") else ""))
            table = sources[src][1]
            over = ""
            if col.endswith("/@base"):
                if "base" not in row:
                    raise TableError(f"column {expr!r}: row {key!r} names no base row")
                col, over = col[: -len("/@base")], row["base"]
            elif "/" in col and col.rsplit("/", 1)[1] in table.rows:  # COLUMN/ROW; a column's name may hold "/"
                col, over = col.rsplit("/", 1)
            value = table.cell(key, col)
            if value is None:
                cells.append(MISSING)
            elif over:
                denominator = table.cell(over, col)
                cells.append(MISSING if denominator is None else f"{number(value) / number(denominator):.2f}")
            else:
                cells.append(value)
        out.append("| " + " | ".join(cells) + " |")
    links = ", ".join(f"[{file}]({os.path.relpath(root / file, page_dir)})" for file, _ in sources.values())
    return "\n".join(out) + f"\n\n<sub>Rendered from {links} by `benchmarks/publish_run.py --tables`.</sub>\n"


def render_page(text: str, root: Path, page_dir: Path) -> str:
    """`text` with every marked table rendered again from its sources."""
    out, pos = [], 0
    for m in START.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(END, m.end())
        if end < 0:
            raise TableError(f"a table spec without {END}")
        try:
            spec = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            raise TableError(f"a table spec that is not JSON: {e}") from None
        out += [text[pos:m.end()], render_table(spec, root, page_dir)]
        pos = end
    return "".join(out) + text[pos:]
