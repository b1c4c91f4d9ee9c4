"""Corrupt drafter files (issue 18, kind 4; unit/corrupt.py holds the mutations and the checks): trained
draft files (blind damage, metadata, config and weights that do not fit, another format) and Katz trigram
files (blind damage, members missing, malformed or out of range)."""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from unit.corrupt import SEED, blind_damage, error_or_load, expect_error, header_flips, safetensors_header, tiny_gguf

from specstack.config import WindowSpec
from specstack.drafting.katz import KatzTrigram
from specstack.models.draft_file import load_draft_file, save_draft
from specstack.training.prune import build_draft


@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_llama, tmp_path_factory) -> Path:
    return tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf"))


# ---------------------------------------------------------------------------------------------------
# Draft files
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_file(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("draft") / "draft.safetensors"
    save_draft(build_draft(tiny_llama.lm.model, n_layers=1, keep=(1,), window=WindowSpec(1, 16)), path)
    return path


def _draft_parts(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def test_draft_loads(draft_file, tiny_llama):
    assert load_draft_file(draft_file, tiny_llama.lm, "fp32").config.n_layers == 1


def test_damaged_draft_file(draft_file, tiny_llama, tmp_path):
    data = draft_file.read_bytes()
    header = safetensors_header(data)
    for label, damaged in [*blind_damage(data, header), *header_flips(data, header)]:
        path = tmp_path / f"{label}.safetensors"
        path.write_bytes(damaged)
        error_or_load(lambda p=path: load_draft_file(p, tiny_llama.lm, "fp32"), str(path))
        if not label.startswith("flip"):
            expect_error(lambda p=path: load_draft_file(p, tiny_llama.lm, "fp32"), str(path), "not a readable")


def _config_change(change: Callable[[dict], object]) -> Callable[[dict, dict], None]:
    def apply(_state: dict, meta: dict) -> None:
        new = change(json.loads(meta["config"]))
        meta["config"] = new if isinstance(new, str) else json.dumps(new)
    return apply


BAD_DRAFTS: list[tuple[str, Callable[[dict, dict], None], str]] = [
    ("no-metadata", lambda s, m: m.clear(), "without specstack's draft metadata"),
    ("other-format", lambda s, m: m.update(format="pt"), "without specstack's draft metadata"),
    ("no-config", lambda s, m: m.pop("config"), "no config"),
    ("config-not-json", _config_change(lambda c: "{"), "its config is not JSON"),
    ("config-a-list", _config_change(lambda c: [c]), "no config"),
    ("zero-heads", _config_change(lambda c: {**c, "model": {**c["model"], "n_heads": 0}}), "n_heads must be >= 1"),
    ("negative-ff", _config_change(lambda c: {**c, "model": {**c["model"], "d_ff": -1}}), "d_ff must be >= 1"),
    ("no-window", _config_change(lambda c: {k: v for k, v in c.items() if k != "window"}), "malformed config"),
    ("unknown-field", _config_change(lambda c: {**c, "colour": "red"}), "malformed config"),
    ("bad-window", _config_change(lambda c: {**c, "window": {"sink": -1, "window": 0}}), "invalid sliding window"),
    ("target-layers", _config_change(lambda c: {**c, "target_layers": [99]}), "reads the target's layers [99]"),
    ("more-blocks", _config_change(lambda c: {**c, "model": {**c["model"], "n_layers": 3}, "target_layers": [1] * 3}),
     "its config describes 3 blocks, it holds 1"),
    ("layers-not-blocks", _config_change(lambda c: {**c, "target_layers": [1, 2]}), "one target layer per draft block"),
    ("no-vocab-ids", lambda s, m: s.pop("vocab_ids"), "vocab_ids"),
    ("float-vocab-ids", lambda s, m: s.update(vocab_ids=s["vocab_ids"].float()), "vocab_ids must be token ids"),
    ("vocab-ids-range", lambda s, m: s.update(vocab_ids=s["vocab_ids"] + 1000), "vocab_ids must be token ids"),
    ("weight-shape", lambda s, m: s.update({"norm": torch.zeros(3)}), "its weights do not fit its config"),
    ("weight-missing", lambda s, m: s.pop("norm"), "its weights do not fit its config"),
]


@pytest.mark.parametrize("label, change, phrase", BAD_DRAFTS, ids=[c[0] for c in BAD_DRAFTS])
def test_bad_draft_file(draft_file, tiny_llama, tmp_path, label, change, phrase):
    state, meta = _draft_parts(draft_file)
    change(state, meta)
    path = tmp_path / f"{label}.safetensors"
    save_file(state, str(path), metadata=meta)
    expect_error(lambda: load_draft_file(path, tiny_llama.lm, "fp32"), path.name, phrase)


@pytest.mark.parametrize("other", ["model.safetensors", "gguf"])
def test_draft_of_another_format(tiny_llama, tiny_gguf_file, tmp_path, other):
    path = tmp_path / "draft.safetensors"
    shutil.copy(tiny_llama.path / "model.safetensors" if other != "gguf" else tiny_gguf_file, path)
    phrase = "not a readable safetensors file" if other == "gguf" else "without specstack's draft metadata"
    expect_error(lambda: load_draft_file(path, tiny_llama.lm, "fp32"), str(path), phrase)


# ---------------------------------------------------------------------------------------------------
# Trigram files
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trigram_file(tmp_path_factory) -> Path:
    rng = random.Random(SEED)
    streams = [[rng.randrange(40) for _ in range(200)] for _ in range(5)]
    return KatzTrigram.train(streams, 257).save(tmp_path_factory.mktemp("trigram") / "t.npz")


def test_damaged_trigram(trigram_file, tmp_path):
    data = trigram_file.read_bytes()
    for label, damaged in [*blind_damage(data, 64), *header_flips(data, len(data))]:
        path = tmp_path / f"{label}.npz"
        path.write_bytes(damaged)
        if label.startswith("flip"):
            error_or_load(lambda p=path: KatzTrigram.load(p), str(path))
        else:
            expect_error(lambda p=path: KatzTrigram.load(p), str(path))


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


BAD_TRIGRAMS: list[tuple[str, Callable[[dict], None], str]] = [
    ("meta-not-json", lambda a: a.update(meta=np.array("{")), "cannot read n-gram file"),
    ("meta-a-list", lambda a: a.update(meta=np.array("[1]")), "unsupported format"),
    ("no-vocab", lambda a: a.update(meta=np.array(json.dumps({"format": 1, "k": 5}))), "vocab_size"),
    ("member-missing", lambda a: a.pop("tri_tok"), "tri_tok"),
    ("short-unigram", lambda a: a.update(unigram=a["unigram"][:10]), "the unigram must be 257"),
    ("nan-unigram", lambda a: a.update(unigram=a["unigram"] * np.nan), "the unigram must be 257"),
    ("offsets", lambda a: a.update(bi_off=a["bi_off"][::-1].copy()), "offsets must rise"),
    ("lengths", lambda a: a.update(tri_alpha=a["tri_alpha"][:-1]), "table lengths disagree"),
    ("token-range", lambda a: a.update(bi_tok=a["bi_tok"].astype(np.int64) + 300), "token ids must be in [0, 257)"),
    ("text-table", lambda a: a.update(bi_prob=a["bi_prob"].astype(str)), "1-D array of the right type"),
]


@pytest.mark.parametrize("label, change, phrase", BAD_TRIGRAMS, ids=[c[0] for c in BAD_TRIGRAMS])
def test_bad_trigram(trigram_file, tmp_path, label, change, phrase):
    arrays = _arrays(trigram_file)
    change(arrays)
    path = tmp_path / f"{label}.npz"
    np.savez(path, **arrays)
    expect_error(lambda: KatzTrigram.load(path), str(path), phrase)


def test_trigram_not_a_zip(tiny_llama, tmp_path):
    path = tmp_path / "t.npz"
    shutil.copy(tiny_llama.path / "config.json", path)
    expect_error(lambda: KatzTrigram.load(path), str(path))
