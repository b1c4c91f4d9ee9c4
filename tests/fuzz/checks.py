"""The error contract of one case: its exit code, the one error line, no traceback, the time bound
(`output_problems`), and the files before and after it (`file_problems`, on two `snapshot`s)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.case import Case
from fuzz.runner import Outcome

ERROR_PREFIX = "specstack: error: "

Snapshot = dict[str, tuple[Any, ...]]
DIGEST_LIMIT = 4 << 20  # bigger files are compared by size and mtime only


def snapshot(roots: Iterable[Path]) -> Snapshot:
    """Every file and folder under `roots`: files by size, mtime and (up to DIGEST_LIMIT) content."""
    found: Snapshot = {}
    for root in roots:
        if not root.exists():
            continue
        for p in [root, *(sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])]:
            st = p.lstat()
            if p.is_dir() and not p.is_symlink():
                found[str(p)] = ("folder",)
            else:
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and st.st_size <= DIGEST_LIMIT \
                    else None
                found[str(p)] = ("file", st.st_size, st.st_mtime_ns, digest)
    return found


@dataclass(frozen=True)
class Problem:
    kind: str  # what broke
    where: str  # what to group by: the exception and its frame, or the command
    detail: str = ""


def _under(path: str, outputs: Sequence[str]) -> bool:
    """`path` is an output, inside one, or a folder above one (made to hold it)."""
    p = Path(path)
    return any(o and (p == Path(o) or Path(o) in p.parents or p in Path(o).parents) for o in outputs)


def file_problems(case: Case, code: int | None, before: Snapshot, after: Snapshot) -> list[Problem]:
    """Existing files unchanged unless they are outputs and the case succeeded; nothing new after a
    failure; nothing new outside the outputs after a success."""
    problems = []
    changed = [p for p, s in before.items() if after.get(p) != s]
    touched = [p for p in changed if code != 0 or not _under(p, case.outputs)]
    if touched:
        problems.append(Problem("changed an existing file", case.command,
                                ", ".join(f"{p} ({'removed' if p not in after else 'changed'})" for p in touched)))
    new = [p for p in after if p not in before]
    if code != 0 and new:
        files = any(after[p][0] == "file" for p in new)
        problems.append(Problem("left files behind after failing" if files else
                                "left an empty folder behind after failing", case.command, ", ".join(new[:6])))
    stray = [p for p in new if not _under(p, case.outputs)] if code == 0 else []
    if stray:
        problems.append(Problem("wrote where it was not told to", case.command, ", ".join(stray[:6])))
    return problems


def _lines(err: str) -> list[str]:
    """stderr's lines, progress-bar redraws (carriage returns) split out, blank ones dropped."""
    return [x for line in err.splitlines() for x in line.split("\r") if x.strip()]


def output_problems(case: Case, o: Outcome, seconds: float) -> list[Problem]:
    """The exit code, the one error line, no traceback, the time bound."""
    problems = []
    if o.stopped:
        problems.append(Problem(o.stopped, case.command, o.message))
    elif o.seconds > seconds:
        problems.append(Problem("hang", case.command, f"took {o.seconds:.0f} s (bound {seconds:.0f} s)"))
    if o.escaped:
        problems.append(Problem("exception escaped main", o.escaped, o.message))
    elif o.code == 130:
        problems.append(Problem("exit 130 without a signal", case.command))
    elif o.code is not None and o.code not in case.codes:
        problems.append(Problem(f"exit code {o.code}", case.command, (_lines(o.err) or [""])[-1][:300]))
    if "Traceback" in o.err:
        tb = o.err[o.err.index("Traceback"):].strip().splitlines()
        problems.append(Problem("traceback on stderr", tb[-1][:200] if tb else case.command))
    lines = _lines(o.err)
    errors = [x for x in lines if x.startswith(ERROR_PREFIX)]
    if o.code == 2:
        if not lines or not lines[-1].startswith(ERROR_PREFIX):
            problems.append(Problem("exit 2 without the error line last", case.command,
                                    repr(lines[-1][:200]) if lines else "stderr is empty"))
        elif len(errors) > 1:
            problems.append(Problem("more than one error line", case.command, " | ".join(errors)[:300]))
        elif not lines[-1][len(ERROR_PREFIX):].strip():
            problems.append(Problem("empty error message", case.command))
    if o.code == 0 and errors:
        problems.append(Problem("error line on success", case.command, errors[0][:200]))
    return problems
