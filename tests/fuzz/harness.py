"""A case made, run and checked in its own workspace (`run_case`), a run of many cases (`fuzz`), and the
report of a run: its failures grouped by kind, each with the command line that reproduces it."""
from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fuzz.case import Case
from fuzz.checks import Problem, file_problems, output_problems, snapshot
from fuzz.fixtures import Fixtures
from fuzz.generators import make_case
from fuzz.runner import CASE_SECONDS, Outcome, memory_cap, run_in_process


@dataclass
class Result:
    case: Case
    outcome: Outcome
    problems: list[Problem] = field(default_factory=list)


def _prune(folder: Path, keep: set[Path]) -> None:
    """Remove what appeared under `folder` since `keep` was listed (a case's cache entries)."""
    for p in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def run_case(case: Case, fx: Fixtures, ws: Path, seconds: float = CASE_SECONDS,
             runner: Callable[..., Outcome] = run_in_process) -> Result:
    """Make the case's workspace, run it, check it; the cache entries it made are removed."""
    ws.mkdir(parents=True, exist_ok=True)
    for put in case.puts:
        put.make(ws)
    roots = [ws, *fx.inputs()]
    before = snapshot(roots)
    cached = set(fx.cache.rglob("*"))
    with memory_cap():
        outcome = runner(case.argv, ws, fx.cache, seconds)
    after = snapshot(roots)
    problems = output_problems(case, outcome, seconds)
    if outcome.stopped is None:  # a case stopped half-way may leave its work behind: that is not the finding
        problems += file_problems(case, outcome.code, before, after)
    _prune(fx.cache, cached)
    return Result(case, outcome, problems)


def fuzz(seed: int, count: int, fx: Fixtures, root: Path, start: int = 0, seconds: float = CASE_SECONDS,
         keep: bool = False) -> Iterator[Result]:
    """Cases start .. start + count - 1 of `seed`, each in root/case<index> (removed after it unless
    `keep`)."""
    for index in range(start, start + count):
        ws = root / f"case{index}"
        case = make_case(seed, index, fx, ws)
        try:
            yield run_case(case, fx, ws, seconds)
        finally:
            if not keep:
                shutil.rmtree(ws, ignore_errors=True)


def short(text: str, case: Case, fx: Fixtures) -> str:
    """`text` with the case's workspace as $WS and the fixtures' folder as $FX, printable (an argument
    from undecodable bytes holds surrogates: escaped)."""
    text = text.replace(case.ws, "$WS").replace(str(fx.root), "$FX")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def case_text(r: Result, fx: Fixtures) -> str:
    """One case for a report: its command line, the files it was given, what went wrong."""
    c = r.case
    parts = [f"  case {c.index} [{c.note}] exit {r.outcome.code}, {r.outcome.seconds:.1f} s",
             f"    {short(c.line(), c, fx)}"]
    used = [p for p in c.puts if any(p.rel.split("/")[0] in arg for arg in c.argv)]  # not ones a later change replaced
    parts += [f"    {p}" for p in used if p.data is not None or p.remove or p.cut is not None or p.flips]
    parts += [f"    -> {p.kind}: {short(p.detail, c, fx)}" for p in r.problems if p.detail]
    return "\n".join(parts)


def report(results: Sequence[Result], fx: Fixtures, examples: int = 5) -> str:
    """The failures grouped by kind and where, each group with up to `examples` cases."""
    failed = [r for r in results if r.problems]
    seeds = sorted({r.case.seed for r in results})
    lines = [f"{len(failed)} of {len(results)} cases failed (seed {', '.join(map(str, seeds))}; $FX = {fx.root}, "
             f"$WS = the case's own folder; rerun one: python benchmarks/fuzz_cli.py --seed S --case I)"]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in failed:
        for p in r.problems:
            groups.setdefault((p.kind, p.where), []).append(r)
    for (kind, where), rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"\n{kind}: {where} ({len(rs)} case{'s' * (len(rs) != 1)})")
        lines += [case_text(r, fx) for r in rs[:examples]]
        if len(rs) > examples:
            lines.append(f"  ... and cases {', '.join(str(r.case.index) for r in rs[examples:])}")
    return "\n".join(lines)
