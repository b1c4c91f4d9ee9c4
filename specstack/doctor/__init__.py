"""What `specstack doctor` reports: the machine, what specstack chose on it, the cache folder, the
installed extras and peer binaries, the registered models, and the problems among them with their fixes.

Read only, and fast: nothing is compiled, assembled, loaded or written. The kernel tables are asked what
they would choose inside `native.planning()`, where a native kernel that is not built yet counts as
available when the CPU, the compiler and ninja are there (a run builds it on first use), so the answer
is the choice a run would make, from the same tables and the same rules (`kernel_table.choose`,
`quant.default_format`), not a second copy of them (a build that would fail for another reason, a
compiler error, is not foreseen: the run then says so on stderr and falls back).

A *problem* is something that makes specstack slower or stops it (no compiler where the CPU could run
the native kernels, a kernel variable naming a kernel that cannot run, the default model missing); a
missing extra, peer binary or other registered model is *optional*: listed with its fix, never counted.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from specstack.doctor.installed import extras, models, peer_binaries
from specstack.doctor.probe import COMPILER_FIX, CPU_FLAGS, cache, choices, machine
from specstack.doctor.report import Problem, Report
from specstack.doctor.text import render
from specstack.machine import cpu_flags

__all__ = ["COMPILER_FIX", "CPU_FLAGS", "Report", "choices", "extras", "gather", "models", "render", "to_json"]


# ---------------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------------
def problems(report: Report) -> tuple[list[Problem], list[str]]:
    """(the problems, with their fixes; the optional pieces that are not installed)."""
    found = []
    c = report.choices
    if c.native_problem and c.native_fix:  # a CPU without AVX2 has nothing to fix: a fact, not a problem
        found.append(Problem("choices", c.native_problem, c.native_fix))
    for t in c.tables:
        if t.error:
            found.append(Problem("choices", t.error, f"unset {t.env} or set it to one of: {', '.join(t.usable)}"))
    for m in report.models:
        if m.default and not m.present and m.fix:
            found.append(Problem("models", f"the default model {m.name} is not installed", m.fix))
    optional = [f"the {e.name} extra" for e in report.extras if not e.installed]
    optional += [b.name for b in report.peer_binaries if b.path is None]
    optional += [m.name for m in report.models if not m.default and not m.present]
    return found, optional


def gather() -> Report:
    """Everything `specstack doctor` prints, read from this machine (nothing built, loaded or written)."""
    report = Report(machine(), choices(), cache(), extras(flags=cpu_flags()), peer_binaries(), models())
    found, optional = problems(report)
    return replace(report, problems=found, optional_missing=optional)


def to_json(report: Report) -> dict[str, Any]:
    """The report as one JSON object: the same fields as the text, plus `ok` and `summary`."""
    return {**asdict(report), "ok": not report.problems, "summary": report.summary()}
