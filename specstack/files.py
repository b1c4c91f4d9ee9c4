"""Files in and out, one set of rules for every command (and, to come, the server's requests).

- Outputs are checked before any work starts (`check_writable_file`, `check_writable_dir`): a long run
  must not end in a traceback with its result lost. "Writable" is tested, not guessed: a temporary
  file is created and removed beside the target (permissions, read-only mounts and pseudo file
  systems such as /proc all answer the same way).
- Outputs are written atomically (`atomic_output`, `atomic_write_text`, `atomic_write_bytes`): the
  data goes to a temporary file beside the target, renamed onto it once complete, so an error or a
  Ctrl-C never leaves a half-written file (the old one, if any, stays until the rename).
- Inputs are read with their encoding checked (`read_text`, `decode_utf8`): strict UTF-8, the first
  bad byte named by its offset and line.
- A run that fails removes what it created (`new_paths`, `remove_paths`), never what was there.

Torch-free (foundation layer): the cheap checks run before any heavy import.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specstack.errors import SpecstackError


@dataclass(frozen=True)
class FileStamp:
    """What identifies a file on disk without reading it (its resolved path, size and mtime): a rewrite or
    a reinstall changes it (the chunked weights' assembly, the built-model cache's records)."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(str(path.resolve()), st.st_size, st.st_mtime_ns)

    def holds(self) -> bool:
        """Whether the file this stamp was taken of is still there as it was."""
        try:
            return FileStamp.of(Path(self.path)) == self
        except OSError:
            return False


def cache_root() -> Path:
    """Where specstack keeps what it builds (converted weights, assembled GGUFs, measured curves):
    SPECSTACK_CACHE, else ~/.cache/specstack."""
    return Path(os.environ.get("SPECSTACK_CACHE", Path.home() / ".cache" / "specstack"))


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _probe(folder: Path, flag: str, target: Path) -> None:
    """Create and remove a temporary file in `folder`: the one test every writer passes."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specstack-probe-"):
            pass
    except OSError as e:
        raise SpecstackError(f"{flag} {target}: cannot write in {folder} ({_reason(e)})") from None


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (what a mkdir -p would create under)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: Path, flag: str) -> None:
    """`path` is a folder this process can write in, or one it can create (then nothing is created
    now: the nearest existing ancestor must be a writable folder)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise SpecstackError(f"{flag} {path} is a file, not a folder")
        _probe(path, flag, path)
        return
    base = _nearest_existing(path)
    if not base.is_dir():
        raise SpecstackError(f"{flag} {path}: {base} is a file, not a folder")
    _probe(base, flag, path)


def check_writable_file(path: Path, flag: str, parents: bool = False) -> None:
    """`path` can be written as a regular file: not a folder or a device, in a writable folder (which
    must exist, unless `parents`: then the writer creates it)."""
    path = Path(path)
    if path.is_dir():
        raise SpecstackError(f"{flag} {path} is a folder: give the file to write")
    if path.exists() and not path.is_file():
        raise SpecstackError(f"{flag} {path} is not a regular file")
    folder = path.parent
    if parents:
        check_writable_dir(folder, flag)
        return
    if not folder.is_dir():
        raise SpecstackError(f"{flag} {path}: folder {folder} does not exist")
    _probe(folder, flag, path)


# ---------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------
def _new_file_mode(path: Path) -> int:
    """The mode a plain open() would give `path`: the old file's, or 0o666 less the umask (mkstemp
    makes 0o600 files)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextmanager
def atomic_output(path: Path, parents: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` to write to (it keeps `path`'s suffix, for writers that read the
    format from it); renamed onto `path` when the block ends, removed if it raises (Ctrl-C too).
    `parents`: create `path`'s folder first."""
    path = Path(path).resolve() if Path(path).is_symlink() else Path(path)  # write where it points, as open() does
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes, parents: bool = False) -> None:
    """Write `data` to `path` in one rename (see atomic_output); flushed to disk before the rename."""
    with atomic_output(path, parents) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str, parents: bool = False) -> None:
    """Write `text` as UTF-8 to `path` in one rename (see atomic_output)."""
    atomic_write_bytes(path, text.encode("utf-8"), parents)


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------
def decode_utf8(data: bytes, where: str) -> str:
    """`data` as strict UTF-8 (a leading BOM dropped); the first bad byte named by offset and line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SpecstackError(f"{where} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}, "
                             f"line {line})") from None


def read_bytes(path: Path, what: str) -> bytes:
    """The bytes of `path`; a missing file, a folder or an unreadable file is one clear error naming
    `what` it is ("prompt file") and the path."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SpecstackError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise SpecstackError(f"{what} is a directory: {path}") from None
    except OSError as e:
        raise SpecstackError(f"cannot read {what} {path}: {_reason(e)}") from None


def read_text(path: Path, what: str) -> str:
    """The text of `path`, strict UTF-8 (read_bytes, decode_utf8)."""
    return decode_utf8(read_bytes(path, what), f"{what} {path}")


# ---------------------------------------------------------------------------------------------------
# Cleaning up after a failed run
# ---------------------------------------------------------------------------------------------------
def new_paths(paths: Iterable[Path]) -> list[Path]:
    """Those of `paths` that do not exist yet: what a run may create and, if it fails, remove."""
    return [Path(p) for p in paths if not os.path.lexists(p)]


def remove_paths(paths: Iterable[Path]) -> None:
    """Remove each of `paths` that exists (a folder with everything in it). Best effort: this runs
    while another error is on its way out, which must not be hidden by a second one."""
    for p in paths:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif os.path.lexists(p):
                p.unlink()
        except OSError:
            pass
