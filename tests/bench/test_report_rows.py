"""read_rows: a run's rows from results.jsonl, or from results.jsonl.gz beside it (how a run committed
under docs/bench keeps them), so `--ratios`, `--phases`, `throughput-check` read either folder;
benchmarks/publish_run.py, which writes such a folder; and the scripts of benchmarks/ still import."""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from specstack.bench.rows import read_rows
from specstack.bench.tables import phase_table, ratio_table
from specstack.errors import SpecstackError

REPO = Path(__file__).resolve().parents[2]

ROWS = [
    {"task_id": "a", "method": "ar", "repeat": 0, "new_tokens": 4, "seconds": 2.0, "tokens_per_s": 2.0,
     "target_forwards": 4, "phases": {"prefill": 0.5, "decode": 1.5}},
    {"task_id": "a", "method": "ngram", "repeat": 0, "new_tokens": 4, "seconds": 1.0, "tokens_per_s": 4.0,
     "target_forwards": 2, "phases": {"prefill": 0.25, "draft": 0.25, "decode": 0.75}},
    {"task_id": "b", "method": "ar", "repeat": 0, "new_tokens": 4, "seconds": 4.0, "tokens_per_s": 1.0,
     "target_forwards": 4, "phases": {"prefill": 1.0, "decode": 3.0}},
    {"task_id": "b", "method": "ngram", "repeat": 0, "new_tokens": 4, "seconds": 1.0, "tokens_per_s": 4.0,
     "target_forwards": 2, "phases": {"prefill": 0.25, "draft": 0.25, "decode": 0.75}},
]


def _text(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_plain_and_gzip_give_the_same_rows(tmp_path: Path):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    (plain / "results.jsonl").write_text(_text(ROWS), encoding="utf-8")
    (packed / "results.jsonl.gz").write_bytes(gzip.compress(_text(ROWS).encode()))
    assert read_rows(plain / "results.jsonl") == ROWS
    assert read_rows(packed / "results.jsonl") == ROWS  # the plain name finds the .gz beside it
    assert read_rows(tmp_path / "results.jsonl") == []  # neither file: no rows
    # the readers of a committed run see the same numbers from either file
    assert ratio_table(packed, ["ngram/ar"]) == ratio_table(plain, ["ngram/ar"])
    assert "| ngram / ar | 3.000 | 2.828 | 3.000 | 2.00 – 4.00 | 2 |" in ratio_table(packed, ["ngram/ar"])
    assert phase_table(packed) == phase_table(plain)


def test_plain_file_wins_and_a_cut_off_gzip_is_dropped_like_a_plain_one(tmp_path: Path):
    (tmp_path / "results.jsonl").write_text(_text(ROWS[:1]), encoding="utf-8")
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress(_text(ROWS).encode()))
    assert read_rows(tmp_path / "results.jsonl") == ROWS[:1]  # a run being written beside an old copy
    (tmp_path / "results.jsonl").unlink()
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress((_text(ROWS[:2]) + '{"task_id": "b", "me').encode()))
    assert read_rows(tmp_path / "results.jsonl") == ROWS[:2]


def test_a_damaged_gzip_is_a_one_line_error(tmp_path: Path):
    (tmp_path / "results.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(SpecstackError, match="not a readable gzip file"):
        read_rows(tmp_path / "results.jsonl")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
def test_a_bad_line_names_the_file_and_the_line(tmp_path: Path, packed: bool):
    """Only text after the last newline that is no JSON is a row cut off by an interrupted run (rows are
    written whole, newline last); any other bad line is an error: no row is dropped silently."""
    path = tmp_path / ("results.jsonl.gz" if packed else "results.jsonl")

    def rows_of(data: bytes) -> list[dict]:
        path.write_bytes(gzip.compress(data) if packed else data)
        return read_rows(tmp_path / "results.jsonl")

    row = json.dumps(ROWS[0]).encode()
    for data, what in ((row + b"\n{}\n" + row + b"\n", "missing or malformed: task_id, method, repeat"),
                       (row + b"\n[1]\n", "not a row of `specstack bench`"),
                       (row + b"\nnot json\n" + row + b"\n", "not valid JSON"),
                       (row + b'\n{"task_id": "a"}', "missing or malformed: method")):  # JSON: not cut off
        with pytest.raises(SpecstackError, match=f"^{path}:2: .*{re.escape(what)}"):
            rows_of(data)
    with pytest.raises(SpecstackError, match=rf"^{path} is not valid UTF-8 \(byte 0xff at offset \d+, line 2\)"):
        rows_of(row + b'\n{"task_id": "\xff"}\n' + row + b"\n")
    assert rows_of(row + b"\n" + row) == ROWS[:1] * 2  # a whole last row without its newline counts


def _script(relative: str) -> ModuleType:
    """A module of benchmarks/ (scripts, not a package, and the modules a script beside them imports),
    imported by path without running it, its folder first on the path as `python script.py` has it."""
    path = REPO / "benchmarks" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    # registered while it runs, as `python script.py` registers __main__: a dataclass in the script
    # looks its module up in sys.modules
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        for name in set(sys.modules) - before:  # its sibling modules too: another folder may reuse a name
            if str(REPO / "benchmarks") in str(getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
        sys.modules.pop(spec.name, None)
    return module


def test_publish_run_keeps_the_tables_and_drops_the_per_token_arrays(tmp_path: Path):
    publish_run = _script("publish_run.py")
    src, dst = tmp_path / "bench_out" / "run", tmp_path / "docs" / "run"
    src.mkdir(parents=True)
    full = [{**r, "tokens": [1, 2, 3, 4], "token_origins": [0, 1, 1, 0], "accepted_per_step": [1, 2]} for r in ROWS]
    (src / "results.jsonl").write_text(_text(full), encoding="utf-8")
    for name in ("summary.json", "summary.md", "speedup_per_prompt.png", "tau_hist.png"):
        (src / name).write_text(name, encoding="utf-8")
    written = publish_run.publish(src, dst, rows=True, figures=["speedup_per_prompt.png"])
    assert sorted(p.name for p in written) == ["results.jsonl.gz", "speedup_per_prompt.png", "summary.json",
                                               "summary.md"]
    assert not (dst / "tau_hist.png").exists() and not (dst / "results.jsonl").exists()
    assert read_rows(dst / "results.jsonl") == ROWS  # every field but the per-token arrays
    assert ratio_table(dst, ["ngram/ar"]) == ratio_table(src, ["ngram/ar"])
    # the same rows give the same bytes: publishing again adds nothing to the history
    assert publish_run.packed_rows(src) == (dst / "results.jsonl.gz").read_bytes()


def test_publish_run_refuses_rows_into_docs(tmp_path: Path):
    """docs/ keeps no rows (tests/unit/test_docs_site.py): asked for them there, nothing is written."""
    publish_run = _script("publish_run.py")
    src = tmp_path / "run"
    src.mkdir()
    (src / "results.jsonl").write_text(_text(ROWS), encoding="utf-8")
    (src / "summary.json").write_text("{}", encoding="utf-8")
    dst = REPO / "docs" / "bench" / "never-written"
    with pytest.raises(SystemExit, match="docs/ keeps no rows"):
        publish_run.publish(src, dst, rows=True, figures=[])
    assert not dst.exists()


@pytest.mark.parametrize("relative", sorted(str(p.relative_to(REPO / "benchmarks"))
                                            for p in (REPO / "benchmarks").rglob("*.py")))
def test_benchmark_scripts_import_what_the_package_has(relative: str):
    """The scripts (and the modules beside them that they import) import specstack's modules by name: a
    rename there must show here, not when a measurement is repeated months later."""
    module = _script(relative)
    if 'if __name__ == "__main__"' in (REPO / "benchmarks" / relative).read_text(encoding="utf-8"):
        assert callable(module.main)
