"""The built-model cache is keyed by the source's bytes, not where the source lies, and keeps no folder
for a source that is gone: reinstalling the same weights elsewhere (a new virtual environment, a CI
clone) converts nothing again and leaves nothing behind (models/model_cache)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from unit.test_corrupt_checkpoints import _from_cache_only, _logits

from specstack.models import loading, model_cache
from specstack.models.loading import load_model, model_cache_dir
from specstack.models.registry import resolve


def _load(path: Path) -> torch.Tensor:
    return _logits(load_model(str(path), dtype="fp32", tokenizer=False))


def _folders(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if model_cache.FOLDER.match(p.name))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    os.utime(dst / "model.safetensors", ns=(1, 10**18))  # a reinstall: another path and another mtime
    return dst


def _change_weights(path: Path) -> None:
    """The same files, other bytes (a fine-tune saved over the checkpoint)."""
    weights = load_file(str(path / "model.safetensors"))
    name = next(k for k, v in weights.items() if v.dim() == 2)
    weights[name] = weights[name] + 0.25
    save_file(weights, str(path / "model.safetensors"))


def test_the_same_weights_at_another_path_share_one_folder(tiny_llama, tmp_path, cache, monkeypatch):
    first = _copy(tiny_llama.path, tmp_path / "venv-a" / "model")
    expected = _load(first)
    (folder,) = _folders(cache)
    shutil.rmtree(first)  # the old environment is gone, the same weights installed elsewhere
    second = _copy(tiny_llama.path, tmp_path / "venv-b" / "model")  # a folder is named by the source's name
    _from_cache_only(monkeypatch)
    assert torch.equal(_load(second), expected)
    assert _folders(cache) == [folder]
    record = model_cache.read_record(folder)
    assert record is not None and [s[0].path for s in record] == [str((second / "config.json").resolve())], \
        "the record names the source as it is now, and forgets the one that is gone"


def test_a_recorded_source_is_found_without_reading_its_bytes(tiny_llama, tmp_path, cache, monkeypatch):
    src = _copy(tiny_llama.path, tmp_path / "model")
    expected = _load(src)

    def no_hashing(*_a, **_k):
        raise AssertionError("the source was hashed although its folder's record names it")

    monkeypatch.setattr(model_cache, "content_key", no_hashing)
    _from_cache_only(monkeypatch)
    assert torch.equal(_load(src), expected)
    assert model_cache_dir(resolve(str(src))) == _folders(cache)[0]


def test_changed_weights_get_another_folder_and_the_old_one_is_swept(tiny_llama, tmp_path, cache):
    src = _copy(tiny_llama.path, tmp_path / "model")
    before = _load(src)
    (old,) = _folders(cache)
    _change_weights(src)
    after = _load(src)
    assert not torch.equal(after, before), "the changed weights were not converted again"
    (new,) = _folders(cache)
    assert new != old and not old.exists()


def test_folders_whose_sources_are_gone_are_swept_when_one_is_made(tiny_llama, tiny_gpt2, tmp_path, cache):
    kept = _copy(tiny_gpt2.path, tmp_path / "kept" / "model")
    _load(kept)
    gone = _copy(tiny_llama.path, tmp_path / "gone" / "model")
    _load(gone)
    legacy = cache / "model-0123456789abcdef"  # the old layout: no record, so it can never be found again
    legacy.mkdir()
    (legacy / "fp32-cpu.safetensors").write_bytes(b"old")
    assert len(_folders(cache)) == 3
    shutil.rmtree(gone)
    other = _copy(tiny_llama.path, tmp_path / "other" / "model")
    _change_weights(other)
    _load(other)  # a new folder: the sweep runs
    left = _folders(cache)
    assert model_cache_dir(resolve(str(kept))) in left and model_cache_dir(resolve(str(other))) in left
    assert len(left) == 2, f"stale folders kept: {left}"


def test_a_damaged_record_is_rewritten_and_the_folder_still_found(tiny_llama, tmp_path, cache, monkeypatch):
    src = _copy(tiny_llama.path, tmp_path / "model")
    expected = _load(src)
    (folder,) = _folders(cache)
    (folder / model_cache.RECORD).write_text("{")
    _from_cache_only(monkeypatch)
    assert torch.equal(_load(src), expected)  # found by hashing the source, and recorded again
    assert json.loads((folder / model_cache.RECORD).read_text())["sources"]
    assert _folders(cache) == [folder]


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_load(tiny_llama, tmp_path, cache, monkeypatch,
                                                                    capsys):
    src = _copy(tiny_llama.path, tmp_path / "model")
    expected = _load(src)
    shutil.rmtree(cache)

    def full_disk(*_a, **_k):  # a full disk cannot be made here: the writer fails as one would
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loading, "save_file", full_disk)
    assert torch.equal(_load(src), expected)
    err = capsys.readouterr().err
    assert "specstack: warning: the converted model was not cached" in err and "No space left" in err
    (folder,) = _folders(cache)
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.tmp"))
