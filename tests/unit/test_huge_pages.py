"""A model's weights on huge pages (models/huge_pages.py): large tensors moved, bytes and sharing kept,
into a mapping the kernel marks eligible for transparent huge pages; small ones, the embedding and a
process that turned it off left where they were; a loaded model and a draft's cut head moved."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specstack.attention import build_batch
from specstack.engine import draft_sources
from specstack.engine.draft_sources import restricted_head
from specstack.models import huge_pages
from specstack.models.loading import load_model

THP = huge_pages.thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason="this kernel has transparent huge pages off (nothing to ask for)")


def thp_eligible(t: torch.Tensor) -> bool:
    """What /proc/self/smaps says of the mapping holding `t`'s first byte: may it have huge pages."""
    at, inside = t.data_ptr(), False
    for line in open("/proc/self/smaps"):
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= at < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@needs_thp
def test_large_tensors_move_with_their_bytes_and_sharing():
    big = torch.randn(700_000)  # 2.8 MB
    view = big[1000:3000].view(40, 50)  # another tensor on the same storage
    other = torch.arange(600_000, dtype=torch.int32).view(1000, 600)
    small = torch.randn(100)
    before = [t.clone() for t in (big, view, other, small)]
    offset, small_at = view.data_ptr() - big.data_ptr(), small.data_ptr()
    moved = huge_pages.move_to_huge_pages([big, view, other, small])
    assert moved >= big.numel() * 4 + other.numel() * 4
    assert all(torch.equal(t, b) for t, b in zip((big, view, other, small), before, strict=True))
    assert view.data_ptr() - big.data_ptr() == offset and view.shape == (40, 50)  # still one storage
    assert huge_pages.on_huge_pages(big) and huge_pages.on_huge_pages(other)
    assert not huge_pages.on_huge_pages(small) and small.data_ptr() == small_at
    assert thp_eligible(big) and thp_eligible(other) and big.data_ptr() % huge_pages.ALIGN == 0
    assert huge_pages.move_to_huge_pages([big, view, other]) == 0  # already there: not moved twice
    big.add_(1)  # writable, and still the same storage under both tensors
    assert torch.equal(view, (before[0] + 1)[1000:3000].view(40, 50))


def test_a_mapping_holds_whole_huge_pages_over_its_bytes_wherever_it_starts():
    """From the first 2 MiB boundary of a mapping, whole huge pages cover the bytes moved, at any start
    the kernel may give it: a small move's mapping sized to its bytes alone may hold no whole aligned huge
    page, and then gets none (seen: a draft's 1.3 MB cut head on 4 KiB pages)."""
    page = 4096
    for total in (1, page, huge_pages.HUGE - 1, huge_pages.HUGE, huge_pages.HUGE + 1, 5 * huge_pages.HUGE + 123):
        whole = -(-total // huge_pages.HUGE) * huge_pages.HUGE
        for start in range(0, 2 * huge_pages.HUGE, page):  # the mapping's start address, page-aligned
            first = start + -start % huge_pages.HUGE
            assert first + whole <= start + huge_pages.mapping_bytes(total), (total, start)


def test_turned_off_or_without_thp_nothing_moves(monkeypatch, tmp_path):
    t = torch.randn(700_000)
    at = t.data_ptr()
    monkeypatch.setenv(huge_pages.FORCE_ENV, "0")
    assert huge_pages.move_to_huge_pages([t]) == 0 and t.data_ptr() == at
    monkeypatch.delenv(huge_pages.FORCE_ENV)
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    mode.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode() == "never" and huge_pages.move_to_huge_pages([t]) == 0 and t.data_ptr() == at
    mode.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode() == "madvise" and huge_pages.enabled() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "absent")
    assert huge_pages.thp_mode() is None and not huge_pages.enabled()


def test_doctor_says_where_the_weights_will_live(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    mode.write_text("always madvise [never]\n")
    assert huge_pages.describe() == "4 KiB pages (transparent huge pages are never)"
    mode.write_text("[always] madvise never\n")
    assert huge_pages.describe().startswith("huge pages, asked for at load (transparent huge pages: always;")
    monkeypatch.setenv(huge_pages.FORCE_ENV, "0")
    assert huge_pages.describe() == f"4 KiB pages ({huge_pages.FORCE_ENV}=0)"
    monkeypatch.delenv(huge_pages.FORCE_ENV)
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "absent")
    assert huge_pages.describe() == "4 KiB pages (this kernel has no transparent huge pages)"


@needs_thp
def test_a_loaded_model_streams_its_weights_from_huge_pages(monkeypatch, tmp_path):
    """The layers' codes and the head move at load, the embedding (read a row a token) stays; the model
    computes what one loaded without the move does, bit for bit; a draft's cut head moves too."""
    lm = load_model("smollm2-135m", dtype="w4a8")
    model = lm.model
    assert huge_pages.on_huge_pages(model.head.weight) and thp_eligible(model.head.weight)
    assert not huge_pages.on_huge_pages(model.embed)
    monkeypatch.setenv(huge_pages.FORCE_ENV, "0")
    plain = load_model("smollm2-135m", dtype="w4a8").model
    assert not huge_pages.on_huge_pages(plain.head.weight)
    ids = torch.tensor([lm.tokenizer.encode("def fibonacci(n):")])
    with torch.inference_mode():
        outs = [m.forward(ids, build_batch(cache, ids.shape[1]), cache).logits
                for m in (model, plain) for cache in [m.new_cache(1)]]
    assert torch.equal(*outs)
    monkeypatch.delenv(huge_pages.FORCE_ENV)
    rank = tmp_path / "rank.npy"
    np.save(rank, np.arange(1000, 3000, dtype=np.int32))
    monkeypatch.setattr(draft_sources, "token_rank_path", lambda name: rank)
    cut = restricted_head(lm, lm, 2000)
    assert cut.model.head.weight.untyped_storage().nbytes() >= huge_pages.MIN_BYTES
    assert huge_pages.on_huge_pages(cut.model.head.weight) and thp_eligible(cut.model.head.weight)
