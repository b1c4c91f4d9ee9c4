"""Where a source's built models are kept: one folder per source *content*, and no folder kept for a
source that is gone.

A folder was once named by the source file's path, size and mtime, so every reinstall of the same
weights (a fresh virtual environment, a CI clone: another path, another mtime) converted them again into
a new folder and the old ones stayed: the cache grew by a model's conversions each time until the disk
was full. Now:

- the folder is keyed by the source's bytes (`content_key`: sha256 of the files, their names and the
  cache layout's version), so the same weights anywhere share one folder;
- hashing a gigabyte costs about a second, so each folder keeps a record (`source.json`) of the files
  (path, size, mtime) it was found for, and a source whose stamps a record holds is found without
  reading it;
- when a folder is created, every folder whose recorded sources no longer exist as recorded (deleted,
  changed, reinstalled elsewhere) is removed (`sweep`), and so is a folder of the old layout (no record):
  it can never be found again. A folder is created with its record in it (a rename of a prepared
  folder), so a sweep in another process never sees a folder being built without one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

from specstack.files import FileStamp, atomic_write_text, cache_root
from specstack.models.registry import ModelSource

CACHE_VERSION = "7"  # bump whenever the built layout (or the key's recipe) changes
RECORD = "source.json"
FOLDER = re.compile(r"^(?P<model>.+)-(?P<key>[0-9a-f]{16})$")
CHUNK = 1 << 22


def source_files(src: ModelSource) -> list[Path]:
    """The files whose bytes a build of `src` reads: the GGUF, or every file of the checkpoint folder."""
    return [src.path] if src.path.is_file() else sorted(p for p in src.path.iterdir() if p.is_file())


def content_key(files: list[Path]) -> str:
    """The key of these files' bytes (and names: a renamed shard of a checkpoint is another checkpoint)."""
    h = hashlib.sha256(f"specstack-cache {CACHE_VERSION}\n".encode())
    for f in files:
        h.update(f"{f.name}|{f.stat().st_size}\n".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()[:16]


def _prefix(src: ModelSource) -> str:
    return src.name.replace("/", "--")


Source = tuple[FileStamp, ...]  # one source's files as they were when the folder was found for it


def read_record(folder: Path) -> list[Source] | None:
    """The sources (each its files' stamps) a folder was found for; None when it has no readable record."""
    try:
        data = json.loads((folder / RECORD).read_text())
        return [tuple(FileStamp(str(s["path"]), int(s["size"]), int(s["mtime_ns"])) for s in source)
                for source in data["sources"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(folder: Path, sources: list[Source]) -> None:
    try:
        atomic_write_text(folder / RECORD, json.dumps({"sources": [[asdict(s) for s in source] for source in sources]}))
    except OSError:  # the disk is full or the folder was removed: the record is a memo, the key stays right
        pass


def _holds(source: Source) -> bool:
    return all(s.holds() for s in source)


def _entries(root: Path, prefix: str | None = None) -> list[Path]:
    """The cache's built-model folders (of one source name, when `prefix` is given)."""
    if not root.is_dir():
        return []
    out = []
    for item in root.iterdir():
        m = FOLDER.match(item.name)
        if m and item.is_dir() and (prefix is None or m["model"] == prefix):
            out.append(item)
    return sorted(out)


def find(src: ModelSource, root: Path | None = None) -> Path:
    """The folder for `src`'s built models (it may not exist yet). A folder whose record holds the
    source's current stamps is it; otherwise the source's bytes are hashed once to name it."""
    root = root or cache_root()
    files = source_files(src)
    source = tuple(FileStamp.of(f) for f in files)
    for folder in _entries(root, _prefix(src)):
        if source in (read_record(folder) or []):
            return folder
    return root / f"{_prefix(src)}-{content_key(files)}"


def claim(src: ModelSource, folder: Path) -> None:
    """Make `folder` (from `find`) exist and record `src`'s stamps in it, before anything is built there.
    A new folder appears complete with its record (a prepared folder renamed into place), and creating
    one sweeps the folders whose sources are gone (`sweep`)."""
    source = tuple(FileStamp.of(f) for f in source_files(src))
    if folder.is_dir():
        record = read_record(folder) or []
        if source not in record:  # the same bytes found at another path: remember it, forget the gone
            _write_record(folder, [s for s in record if _holds(s)] + [source])
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _write_record(tmp, [source])
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.is_dir():
            raise
        claim(src, folder)  # another process created it first: that folder is the same content's
        return
    sweep(folder.parent, keep=folder)


def stale(folder: Path) -> bool:
    """Whether a built-model folder can never be found again: no record (the old layout), or none of
    its recorded sources is still there as recorded (every file of it: same path, size and mtime)."""
    record = read_record(folder)
    return record is None or not any(_holds(s) for s in record)


def sweep(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove every stale built-model folder under `root` but `keep`; the folders removed."""
    gone = []
    for folder in _entries(root):
        if folder != keep and stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone
