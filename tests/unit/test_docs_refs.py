"""Every "DESIGN §n" the code cites resolves to a section of docs/DESIGN.md: the design document lives in
the repository, so a reader who clones it can follow each reference, and renumbering a section without
updating its citations fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
# where citations are written: the package, the tests, the benchmark scripts, the docs beside DESIGN.md
SOURCES = [*(ROOT / "specstack").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
           *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "docs").glob("*.md")]

# "## 2. Invariants", "### 2.5 Drafters are plug-ins": the number a heading opens with
HEADING = re.compile(r"^#{2,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
# "DESIGN §6", "DESIGN.md §2.1", "DESIGN §1, §3", "DESIGN §4 and §5": one citation, one or more sections
CITATION = re.compile(r"DESIGN(?:\.md)?[\s#]*((?:§\s*\d+(?:\.\d+)*(?:[\s#]*(?:,|;|/|and|or)[\s#]*(?=§))?)+)")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)")


def design_sections(text: str) -> set[str]:
    return set(HEADING.findall(text))


def citations(text: str) -> list[tuple[int, str]]:
    """(line, section number) of every section a DESIGN citation in `text` names."""
    out = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line, s) for s in SECTION.findall(m.group(1))]
    return out


def test_the_parsers_on_hand_written_text():
    assert design_sections("# t\n\n## 0. What it is\n\n## 2. Invariants\n\n### 2.5 Plug-ins\n") == {"0", "2", "2.5"}
    text = 'x = 1  # DESIGN §6\n"""(DESIGN §1, §3): a\nDESIGN.md §2.1; DESIGN §4 and §5 (DESIGN §7 (b)); §9"""'
    assert [s for _, s in citations(text)] == ["6", "1", "3", "2.1", "4", "5", "7"]
    assert citations("the SPIRe paper's §(d); DESIGN without a section") == []


def test_design_md_has_the_numbered_sections():
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    assert {str(n) for n in range(10)} <= sections  # §0 .. §9
    assert {f"2.{n}" for n in range(1, 8)} <= sections  # the invariants, cited one by one


def test_every_design_citation_resolves():
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    found, missing = 0, []
    for path in SOURCES:
        if path == DESIGN:
            continue
        for line, s in citations(path.read_text(encoding="utf-8")):
            found += 1
            if s not in sections:
                missing.append(f"{path.relative_to(ROOT)}:{line}: DESIGN §{s}")
    assert found >= 40, f"only {found} citations found: has the citation pattern changed?"
    assert not missing, "citations of sections docs/DESIGN.md does not have:\n" + "\n".join(missing)


# --- the benchmark history: `docs/bench-history, "Title"` names a heading (or a bold lead-in) of one of its pages
HISTORY = ROOT / "docs" / "bench-history"
HISTORY_SOURCES = [*SOURCES, *(ROOT / "specstack").rglob("*.h"), *(ROOT / "benchmarks").rglob("*.sh"),
                   ROOT / "pyproject.toml", ROOT / "benchmarks" / "README.md"]
HISTORY_SOURCES.remove(Path(__file__).resolve())  # its examples are not citations
# the quoted title may run on over a comment's next line (`#`, `//` or `*` continue it)
HISTORY_CITATION = re.compile(r'bench-history,?(?: the [^"\n]{1,30}\'s)?\s*"((?:[^"\n]|\n[ \t]*(?:#|//|\*)?[ \t]*)+?)"')
LEAD_IN = re.compile(r"^(?:#{1,6}\s+(.+)|\*\*([^*]+)\*\*)", re.MULTILINE)


def _plain(text: str) -> str:
    return " ".join(re.sub(r"\n[ \t]*(?:#|//|\*)?[ \t]*", " ", text).replace("`", "").split())


def history_titles() -> list[str]:
    return [_plain(a or b) for page in HISTORY.glob("*.md") for a, b in LEAD_IN.findall(page.read_text("utf-8"))]


def history_citations(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, _plain(m.group(1))) for m in HISTORY_CITATION.finditer(text)]


def test_the_history_parsers_on_hand_written_text():
    text = ('# (docs/bench-history, "The real pair"): x\n// docs/bench-history, "Prefetching the\n// weight stream")\n'
            'docs/bench-history)", low=0, zero="no"; docs/bench-history, the w4a8 section\'s "Distance"')
    assert [c for _, c in history_citations(text)] == ["The real pair", "Prefetching the weight stream", "Distance"]


def test_every_history_citation_names_a_section():
    titles = history_titles()
    assert len(titles) > 100 and (HISTORY / "index.md").is_file()
    found, missing = 0, []
    for path in HISTORY_SOURCES:
        for line, cited in history_citations(path.read_text(encoding="utf-8")):
            found += 1
            if not any(cited in t for t in titles):  # a title's start, or its part after a colon
                missing.append(f"{path.relative_to(ROOT)}:{line}: {cited!r}")
    assert found >= 25, f"only {found} citations found: has the citation pattern changed?"
    assert not missing, "citations of docs/bench-history sections that no page has:\n" + "\n".join(missing)


def test_no_reference_to_the_old_benchmarks_log():
    """docs/BENCHMARKS.md became docs/bench-history/ (one page a piece of work) and docs/benchmarks.md."""
    stale = [f"{p.relative_to(ROOT)}" for p in HISTORY_SOURCES if "BENCHMARKS.md" in p.read_text(encoding="utf-8")]
    assert not stale, stale
