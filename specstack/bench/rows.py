"""The rows of a `specstack bench` run on disk: results.jsonl (or the gzip file a published run keeps
beside it) read back strictly, and the run's settings (run.json). Every reader of a run starts here:
the report, --compare / --ratios / --phases, the resume of an interrupted run, the throughput check.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from specstack.errors import SpecstackError
from specstack.files import decode_utf8, read_bytes, read_text

Row = dict[str, Any]

# the fields every reader of rows relies on, and their types
ROW_TYPES: dict[str, tuple[type, ...]] = {"task_id": (str,), "method": (str,), "repeat": (int,), "new_tokens": (int,),
                                          "seconds": (int, float), "tokens_per_s": (int, float)}


def read_rows(path: Path) -> list[Row]:
    """The rows of a results.jsonl, or of the gzip file beside it (`results.jsonl.gz`) when only that
    exists: a run committed under docs/bench keeps its rows compressed and without their per-token
    arrays (benchmarks/publish_run.py). None if neither exists. Text after the last newline that is
    not a row is a row cut off by an interrupted run (rows are written whole, newline last) and is
    dropped; any other bad line is an error naming the file and the line: no row is ever lost."""
    gz = path.with_name(path.name + ".gz")
    if path.is_file():
        source, data = path, read_bytes(path, "results file")
    elif gz.is_file():
        source = gz
        try:
            data = gzip.decompress(read_bytes(gz, "results file"))
        except (OSError, EOFError):  # BadGzipFile is an OSError; EOFError: cut short
            raise SpecstackError(f"{gz}: not a readable gzip file of rows") from None
    else:
        return []
    *lines, last = decode_utf8(data, str(source)).split("\n")
    rows = [parse_row(line, source, n) for n, line in enumerate(lines, 1) if line.strip()]
    if last.strip():
        try:
            json.loads(last)
        except json.JSONDecodeError:
            return rows  # cut off
        rows.append(parse_row(last, source, len(lines) + 1))
    return rows


def parse_row(line: str, source: Path, n: int) -> Row:
    """Line n of `source` as a row (an object with ROW_TYPES' fields), or an error naming both."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecstackError(f"{source}:{n}: not valid JSON ({e.msg})") from None
    bad = [k for k, types in ROW_TYPES.items() if not isinstance(row.get(k), types)] if isinstance(row, dict) \
        else list(ROW_TYPES)
    if bad:
        raise SpecstackError(f"{source}:{n}: not a row of `specstack bench` (missing or malformed: {', '.join(bad)})")
    return row


def read_run(folder: Path) -> dict[str, Any]:
    """A run's settings (DIR/run.json, BenchSettings' fields), checked to be a JSON object."""
    path = Path(folder) / "run.json"
    if not path.is_file():
        raise SpecstackError(f"{folder} holds no run.json: not a `specstack bench` output folder")
    try:
        run = json.loads(read_text(path, "run file"))
    except json.JSONDecodeError as e:
        raise SpecstackError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(run, dict):
        raise SpecstackError(f"{path}: not the settings of a `specstack bench` run (a JSON object)")
    return run

