"""Damaged bytes, JSON and JSONL, and the paths a case gives where an input file or an output is
expected (damaged, missing, a folder, /dev/null, /dev/full, under a file, ...)."""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz.case import Builder


def random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((0, 1, 3, 17, 64, 500)))


def damage_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One blind damage to `data`."""
    n = len(data)
    kind = rng.choice(("cut", "flip", "insert", "delete", "garbage", "random", "invalid-utf8"))
    if kind == "cut" or n == 0:
        at = rng.randrange(n + 1) if n else 0
        return data[:at], f"cut to {at} of {n} bytes"
    if kind == "flip":
        b = bytearray(data)
        spots = sorted(rng.sample(range(n), min(n, rng.choice((1, 3, 20)))))
        for at in spots:
            b[at] ^= rng.randrange(1, 256)
        return bytes(b), f"{len(spots)} bytes flipped"
    if kind == "insert":
        at = rng.randrange(n + 1)
        return data[:at] + rng.randbytes(rng.choice((1, 9, 100))) + data[at:], f"random bytes inserted at {at}"
    if kind == "delete":
        at = rng.randrange(n)
        return data[:at] + data[at + rng.choice((1, 8, 64)):], f"bytes deleted at {at}"
    if kind == "garbage":
        return data + rng.randbytes(rng.choice((1, 50))), "random bytes appended"
    if kind == "invalid-utf8":
        at = rng.randrange(n + 1)
        return data[:at] + rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00")) + data[at:], \
            f"an invalid UTF-8 byte at {at}"
    return random_bytes(rng), "random bytes"


def bad_json_value(rng: random.Random) -> Any:
    return rng.choice((None, 0, -1, 1.5, 2**70, -2**70, float("nan"), float("inf"), "", "x", [], {}, [1, "a"],
                       True, "\udcff", 10**9))


def damage_json(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """A value inside `doc` (a JSON document) replaced, removed, or the whole document replaced."""
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, at: tuple[Any, ...]) -> None:
        paths.append(at)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*at, k))
        elif isinstance(node, list):
            for i, v in enumerate(node[:5]):
                walk(v, (*at, i))

    walk(doc, ())
    at = rng.choice(paths)
    if not at or rng.random() < 0.1:
        return bad_json_value(rng), "the document replaced"
    doc = json.loads(json.dumps(doc))  # a copy
    parent = doc
    for k in at[:-1]:
        parent = parent[k]
    key = at[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
        return doc, f"{'.'.join(map(str, at))} removed"
    value = bad_json_value(rng)
    parent[key] = value
    return doc, f"{'.'.join(map(str, at))} = {value!r}"


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode("utf-8", "surrogatepass")


def damaged_json_file(b: Builder, source: Path, rel: str) -> str:
    """A copy of a JSON file, damaged blindly or in its structure."""
    data = source.read_bytes()
    if b.rng.random() < 0.6:
        doc, what = damage_json(b.rng, json.loads(data))
        data = dumps(doc)
    else:
        data, what = damage_bytes(b.rng, data)
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def damaged_jsonl(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One line of a JSONL file damaged (JSON or bytes), removed, repeated, or a line added."""
    lines = data.split(b"\n")
    i = rng.randrange(max(1, len([x for x in lines if x.strip()])))
    kind = rng.choice(("json", "json", "bytes", "repeat", "add", "empty-object", "blank"))
    if kind == "json":
        doc, what = damage_json(rng, json.loads(lines[i]))
        lines[i] = json.dumps(doc).encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        lines[i], what = damage_bytes(rng, lines[i])
    elif kind == "repeat":
        lines.insert(i, lines[i])
        what = "repeated"
    elif kind == "add":
        lines.insert(i, rng.choice((b"{}", b"[]", b"null", b"1", b'"x"', b"{", random_bytes(rng))))
        what = f"{lines[i][:20]!r} inserted"
    elif kind == "empty-object":
        lines[i] = b"{}"
        what = "now {}"
    else:
        lines[i] = b""
        what = "blanked"
    return b"\n".join(lines), f"line {i + 1} {what}"


def input_file(b: Builder, valid: Path, damage: Callable[[Builder, Path, str], str], ext: str) -> str:
    """A path where a readable file of `valid`'s kind is expected: damaged, missing, a folder, empty, ..."""
    kind = b.pick(("damaged", "damaged", "damaged", "random", "empty", "missing", "folder", "dev-null"))
    rel = b.name("in") + ext
    if kind == "damaged":
        return damage(b, valid, rel)
    b.note(f"{valid.name} -> {kind}")
    if kind == "random":
        return b.put(rel, data=random_bytes(b.rng))
    if kind == "empty":
        return b.put(rel, data=b"")
    if kind == "missing":
        return b.path(rel)
    if kind == "folder":
        return b.put(rel, folder=True)
    return "/dev/null"


def damaged_copy(b: Builder, source: Path, rel: str) -> str:
    data, what = damage_bytes(b.rng, source.read_bytes())
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def damaged_jsonl_copy(b: Builder, source: Path, rel: str) -> str:
    data, what = damaged_jsonl(b.rng, source.read_bytes())
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def output_path(b: Builder, ext: str, folder: bool = False) -> str:
    """Where an output is to be written: fresh (valid), or a path that cannot take it."""
    kind = b.pick(("fresh", "missing-parent", "folder", "proc", "dev-full", "under-a-file", "existing", "empty",
                   "no-suffix" if not folder else "existing-file"))
    rel = b.name("out")
    if kind not in ("fresh",):
        b.note(f"output -> {kind}")
    if kind == "fresh":
        return b.output(b.path(rel + ext))
    if kind == "missing-parent":
        return b.output(b.path(f"no/such/{rel}{ext}"))
    if kind == "folder":
        return b.output(b.put(rel, folder=True)) if folder else b.put(rel, folder=True)
    if kind == "proc":
        return f"/proc/x{ext}"
    if kind == "dev-full":
        return "/dev/full"
    if kind == "under-a-file":
        b.put(rel, data=b"a file")
        return b.output(b.path(f"{rel}/x{ext}"))
    if kind == "existing":
        return b.output(b.put(rel + ext, data=b"old content\n"))
    if kind == "existing-file":  # a file where a folder is expected
        return b.put(rel, data=b"a file")
    if kind == "no-suffix":
        return b.output(b.path(rel))
    return ""  # the empty path
