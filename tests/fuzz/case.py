"""A fuzz case (its command line, the files its workspace is given, the outputs it may write) and the
`Builder` that makes one: a valid baseline, then malformations."""
from __future__ import annotations

import random
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.fixtures import Fixtures


@dataclass(frozen=True)
class Put:
    """One path a case creates in its workspace before it runs: bytes, or a copy of a fixture (file or
    folder), cut to its first `cut` bytes and with bytes XOR-ed at `flips`; or the removal of a path."""

    rel: str
    data: bytes | None = None
    source: Path | None = None
    cut: int | None = None
    flips: tuple[tuple[int, int], ...] = ()
    remove: bool = False
    folder: bool = False  # an empty folder

    def make(self, ws: Path) -> None:
        path = ws / self.rel
        if self.remove:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.folder:
            path.mkdir(exist_ok=True)
            return
        if self.source is not None and self.source.is_dir():
            shutil.copytree(self.source, path, dirs_exist_ok=True)
            return
        data = bytearray(self.data if self.data is not None else self.source.read_bytes())
        if self.cut is not None:
            del data[self.cut:]
        for offset, mask in self.flips:
            if offset < len(data):
                data[offset] ^= mask
        if path.exists() and path.is_dir():
            shutil.rmtree(path)
        path.write_bytes(bytes(data))

    def __str__(self) -> str:
        if self.remove:
            return f"{self.rel}: removed"
        if self.folder:
            return f"{self.rel}/: an empty folder"
        what = repr(self.data[:80]) + ("..." if len(self.data) > 80 else "") if self.data is not None else \
            f"a copy of {self.source.name}"
        if self.cut is not None:
            what += f" cut to {self.cut} bytes"
        if self.flips:
            what += f" with bytes flipped at {[o for o, _ in self.flips]}"
        return f"{self.rel}: {what}"


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    ws: str  # the case's own folder
    command: str
    argv: tuple[str, ...]
    puts: tuple[Put, ...]
    outputs: tuple[str, ...]  # paths the case was told to write (a folder: anything under it)
    note: str  # what is malformed
    codes: frozenset[int] = frozenset({0, 2})

    def line(self) -> str:
        return shlex.join(["specstack", *self.argv])


class Builder:
    """A command line under construction: a valid baseline, then malformations."""

    def __init__(self, rng: random.Random, fx: Fixtures, ws: Path, command: str) -> None:
        self.rng, self.fx, self.ws, self.command = rng, fx, ws, command
        self.positionals: list[str] = []
        self.options: list[tuple[str, str | tuple[str, ...] | None]] = []
        self.puts: list[Put] = []
        self.outputs: list[str] = []
        self.notes: list[str] = []
        self.codes = {0, 2}

    # the command line
    def opt(self, flag: str, value: str | tuple[str, ...] | None = None) -> None:
        """Set `flag` (replacing it where it was given)."""
        self.drop(flag)
        self.options.append((flag, value))

    def add(self, flag: str, value: str | None = None) -> None:
        """Give `flag` once more (a repeatable flag, or a duplicate)."""
        self.options.append((flag, value))

    def positional(self, i: int, value: str) -> None:
        self.positionals[i] = value

    def drop(self, flag: str) -> None:
        self.options = [(f, v) for f, v in self.options if f != flag]

    def get(self, flag: str) -> str | tuple[str, ...] | None:
        return next((v for f, v in self.options if f == flag), None)

    def argv(self) -> tuple[str, ...]:
        out = [*self.command.split(), *self.positionals]
        for flag, value in self.options:
            out += [flag, *([] if value is None else [value] if isinstance(value, str) else value)]
        return tuple(out)

    # the workspace
    def path(self, rel: str) -> str:
        return str(self.ws / rel)

    def put(self, rel: str, **kw: Any) -> str:
        self.puts.append(Put(rel, **kw))
        return self.path(rel)

    def output(self, path: str) -> str:
        self.outputs.append(path)
        return path

    def note(self, text: str) -> None:
        self.notes.append(text)

    def pick(self, items: Sequence[Any]) -> Any:
        return self.rng.choice(items)

    def name(self, stem: str) -> str:
        """A workspace name not used yet by this case."""
        used = {p.rel.split("/")[0] for p in self.puts}
        n = 0
        while f"{stem}{n}" in used:
            n += 1
        return f"{stem}{n}"
