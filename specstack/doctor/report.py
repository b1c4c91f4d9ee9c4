"""The fields of `specstack doctor`'s report (its `--json` is these dataclasses as they are)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass



# ---------------------------------------------------------------------------------------------------
# The report's fields (the JSON of `--json` is these dataclasses as they are, plus the summary)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuFlag:
    name: str
    present: bool | None  # None: unknown (no /proc/cpuinfo on this system)
    why: str


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int | None  # os.cpu_count()
    usable_cores: int | None  # the cores this process may run on (its affinity)
    flags: list[CpuFlag]
    torch: str
    torch_capability: str  # what torch's CPU dispatcher found: DEFAULT, AVX2, AVX512, ...
    torch_threads: int
    python: str
    specstack: str | None


@dataclass(frozen=True)
class NativeKernel:
    name: str
    used_by: str
    state: str  # "built", "out of date", "not built", "cannot build", "not for this CPU"
    path: str | None  # the built library, when there is one
    note: str


@dataclass(frozen=True)
class KernelTable:
    name: str  # what the table computes
    env: str  # the variable that forces one of its entries
    entries: list[str]  # every entry, fastest first
    usable: list[str]  # those that apply on this CPU
    chosen: str | None  # None: the forced value is refused (`error`)
    forced: str | None  # the variable's value, when set
    error: str | None  # what a run would stop with


@dataclass(frozen=True)
class Choices:
    default_dtype: str  # `--dtype` when not given, on cpu
    default_dtype_why: str
    compiler: str  # what torch's extension builder runs: $CXX, else c++
    compiler_path: str | None
    ninja_path: str | None
    native_problem: str | None  # why native kernels cannot be had here (None: they can)
    native_consequence: str | None  # what that means for a run
    native_fix: str | None  # how to get them (None: nothing to do, e.g. a CPU without AVX2)
    bf16_native: bool
    weight_pages: str  # where a loaded model's weights live (models/huge_pages.describe)
    kernels: list[NativeKernel]
    tables: list[KernelTable]


@dataclass(frozen=True)
class CacheEntry:
    path: str  # relative to the cache folder
    bytes: int
    what: str


@dataclass(frozen=True)
class Cache:
    root: str
    from_env: bool  # SPECSTACK_CACHE names it
    exists: bool
    bytes: int
    entries: list[CacheEntry]


@dataclass(frozen=True)
class Extra:
    name: str
    requirements: list[str]
    missing: list[str]  # the requirements not met, each with why
    installed: bool
    fix: str | None


@dataclass(frozen=True)
class PeerBinary:
    name: str
    used_by: str
    path: str | None
    fix: str | None


@dataclass(frozen=True)
class Model:
    name: str
    default: bool  # the model every command runs without --model
    present: bool  # its files are here (a chunked model's parts count: they are assembled on first use)
    path: str | None  # its GGUF, when it is a file already
    detail: str
    converted: list[str]  # its converted weight files in the cache (one per format built)
    fix: str | None


@dataclass(frozen=True)
class Problem:
    section: str
    what: str
    fix: str


@dataclass(frozen=True)
class Report:
    machine: Machine
    choices: Choices
    cache: Cache
    extras: list[Extra]
    peer_binaries: list[PeerBinary]
    models: list[Model]
    problems: list[Problem] = field(default_factory=list)
    optional_missing: list[str] = field(default_factory=list)  # what is not installed and need not be

    def summary(self) -> str:
        optional = f" (not installed, optional: {', '.join(self.optional_missing)})" if self.optional_missing else ""
        if not self.problems:
            return "everything OK" + optional
        n = len(self.problems)
        return f"{n} problem{'s' if n > 1 else ''}: " + "; ".join(p.what for p in self.problems) + optional
