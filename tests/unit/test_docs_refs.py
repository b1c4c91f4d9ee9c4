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
