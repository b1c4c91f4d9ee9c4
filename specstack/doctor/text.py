"""The report as plain text, one section each, the summary last."""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from specstack.doctor.report import Report


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------
def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rows(rows: Iterable[tuple[str, str]], indent: str = "  ") -> list[str]:
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{indent}{k:<{width}}  {v}".rstrip() for k, v in rows]


def _presence(present: bool | None) -> str:
    return "unknown" if present is None else "present" if present else "absent"


def render(report: Report) -> str:
    """The report as plain text, one section each, the summary last."""
    m, c, ca = report.machine, report.choices, report.cache
    lines = ["Machine"]
    cores = f"{m.cores}" + (f" ({m.usable_cores} usable by this process)" if m.usable_cores not in (None, m.cores)
                            else "")
    lines += _rows([("CPU", m.cpu), ("cores", cores),
                    ("torch", f"{m.torch} (CPU capability {m.torch_capability}), {m.torch_threads} threads"),
                    ("python", f"{m.python}, specstack {m.specstack}")])
    lines.append("  instruction sets:")
    lines += _rows(((f.name, f"{_presence(f.present):<8} {f.why}") for f in m.flags), "    ")

    lines += ["", "What specstack chose on this CPU"]
    lines += _rows([("--dtype default", f"{c.default_dtype}: {c.default_dtype_why}"),
                    ("C++ compiler", f"{c.compiler_path or 'not found'}"
                     + (f" (CXX={c.compiler})" if os.environ.get("CXX") is not None else "")),
                    ("ninja", c.ninja_path or "not found"),
                    ("bf16 matmuls", "native" if c.bf16_native else "emulated (wide inputs multiply in fp32)"),
                    ("weights on", c.weight_pages)])
    if c.native_problem:
        lines.append(f"  ! {c.native_problem}: {c.native_consequence}")
        if c.native_fix:
            lines.append(f"    fix: {c.native_fix}")
    lines.append("  native kernels:")
    lines += _rows(((k.name, f"{k.note}  (for {k.used_by})") for k in c.kernels), "    ")
    lines.append("  kernel tables:")
    table_rows = []
    width = max((len(t.chosen or "") for t in c.tables), default=0)
    for t in c.tables:
        forced = f"forced by {t.env}={t.forced}" if t.forced else f"force one with {t.env}={'|'.join(t.entries)}"
        chosen = f"{t.chosen:<{width}}" if t.error is None else f"ERROR: {t.error}"
        table_rows.append((t.name, f"{chosen}  (usable here: {', '.join(t.usable) or 'none'}; {forced})"))
    lines += _rows(table_rows, "    ")

    lines += ["", "Cache folder"]
    where = "SPECSTACK_CACHE" if ca.from_env else "the default; SPECSTACK_CACHE moves it"
    lines.append(f"  {ca.root} ({where}): " + (f"{size(ca.bytes)}" if ca.exists else "not created yet"))
    lines += _rows(((e.path, f"{size(e.bytes):>9}  {e.what}") for e in ca.entries), "    ")

    lines += ["", "Installed extras"]
    width = max((len(e.name) for e in report.extras), default=0)
    for e in report.extras:
        lines.append(f"  {e.name:<{width}}  " + ("installed" if e.installed else f"missing: {', '.join(e.missing)}"))
        if e.fix:
            lines.append(f"  {'':<{width}}  fix: {e.fix}")
    lines.append("  llama.cpp peer binaries:")
    lines += _rows(((b.name, f"found ({b.path})" if b.path else f"not found; for {b.used_by}; build it: {b.fix}")
                    for b in report.peer_binaries), "    ")

    lines += ["", "Models"]
    for md in report.models:
        tag = " (default)" if md.default else ""
        state = f"present, {md.detail}" if md.present else f"missing: {md.detail}"
        lines.append(f"  {md.name}{tag}: {state}")
        if md.path:
            lines.append(f"    {md.path}")
        if md.converted:
            lines.append(f"    converted in the cache: {', '.join(md.converted)}")
        if md.fix:
            lines.append(f"    fix: {md.fix}")

    lines += ["", report.summary()]
    for p in report.problems:
        lines.append(f"  - {p.what}: {p.fix}")
    return "\n".join(lines)
