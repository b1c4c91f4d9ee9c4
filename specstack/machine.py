"""The machine a measurement ran on: CPU model, library versions, the time. Every stored curve and
benchmark result carries these beside its numbers (ratios compare within one machine only)."""
from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The instruction-set flags the kernel reports for the first CPU (None where there is no
    /proc/cpuinfo): `specstack doctor` shows the ones that decide something."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"specstack": package_version("specstack"), "torch": package_version("torch"),
            "transformers": package_version("transformers"),
            "llama-cpp-python": package_version("llama_cpp_python"), "python": platform.python_version()}


def now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")
