"""The machine a measurement ran on: CPU model, library versions, the time. Every stored curve and
benchmark result carries these beside its numbers (ratios compare within one machine only)."""
from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's model name with its family and model numbers: a virtual machine's name can be as
    bare as "AMD EPYC" on a Zen 4 and a Zen 5 alike, and a measured curve of one must not serve the other."""
    try:
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and fields:  # the first CPU's block ends
                break
            fields.setdefault(key, value.strip())
    except OSError:
        fields = {}
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


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
