"""A model's weights on huge pages: its large CPU tensors moved, once after load, into one anonymous
mapping that asks Linux for transparent huge pages (2 MiB) with MADV_HUGEPAGE.

Why: a decode step streams every weight once, at the memory's pace, and on 4 KiB pages that stream
crosses a page, a TLB entry and a boundary where the hardware prefetchers stop every 4 KiB. Linux's
common transparent-huge-page mode, `madvise`, gives huge pages only to memory that asks for them, and
torch's allocator never asks: a loaded model sat on 4 KiB pages (docs/bench-history, "Weights on huge
pages", has the step it cost). A mapping of our own asks; where the kernel has no huge page to give
(memory fragmented, THP off) it keeps small ones, so the move is never wrong, only sometimes idle.

The tensors keep their objects (each is re-pointed with `set_`), so every module and every list that
holds one sees the new memory; tensors sharing a storage (a tied head) still share it. `SPECSTACK_HUGE_PAGES=0`
leaves the weights where they are (A/B runs).
"""
from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

FORCE_ENV = "SPECSTACK_HUGE_PAGES"  # "0": leave the weights on the allocator's pages
HUGE = 2 << 20  # a huge page: the mapping's tensors start on such a boundary
MIN_BYTES = 1 << 20  # smaller storages stay put: copying them wins nothing a step reads at speed
ALIGN = 64  # each storage's start in the mapping (a cache line: what the kernels' loads assume at most)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# the start address of each live mapping: a storage already in one is not moved again (the entry goes
# when the mapping is freed, so a later allocation at the same address is not mistaken for one)
_MAPPINGS: set[int] = set()


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), None where it has none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def enabled() -> bool:
    """Whether moving weights can win anything here: asked for, Linux's madvise, THP not off."""
    return os.environ.get(FORCE_ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def describe() -> str:
    """Where a loaded model's weights will live, in words (`specstack doctor`)."""
    mode = thp_mode()
    if os.environ.get(FORCE_ENV, "1") == "0":
        return f"4 KiB pages ({FORCE_ENV}=0)"
    if not enabled():
        why = "this kernel has no transparent huge pages" if mode is None else f"transparent huge pages are {mode}"
        return f"4 KiB pages ({why})"
    return f"huge pages, asked for at load (transparent huge pages: {mode}; {FORCE_ENV}=0 keeps 4 KiB pages)"


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether `t`'s storage lives in a mapping this module made (advised for huge pages)."""
    return t.untyped_storage().data_ptr() in _MAPPINGS


def mapping_bytes(total: int) -> int:
    """The length of a mapping for `total` bytes: whole huge pages over them from the first 2 MiB boundary
    in it (a mapping that holds no whole aligned huge page, as a small move's could, gets none), and a huge
    page's worth before them, wherever the kernel puts its start, to find that boundary in."""
    return HUGE + -(-total // HUGE) * HUGE


def move_to_huge_pages(tensors: Iterable[torch.Tensor], min_bytes: int = MIN_BYTES) -> int:
    """Move the CPU tensors among `tensors` whose storage holds at least `min_bytes` (each storage once,
    with every one of them on it) into one new mapping advised for huge pages; the bytes moved (0:
    nothing to move, or huge pages cannot be asked for here)."""
    if not enabled():
        return 0
    on_storage: dict[int, list[torch.Tensor]] = {}  # a storage's address -> the tensors on it
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "cpu" or s.nbytes() < min_bytes or s.data_ptr() in _MAPPINGS:
            continue
        on_storage.setdefault(s.data_ptr(), []).append(t)
    if not on_storage:
        return 0
    offsets, total = {}, 0
    for ptr, on in on_storage.items():
        offsets[ptr] = total
        total += -(-on[0].untyped_storage().nbytes() // ALIGN) * ALIGN
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting
    mapping = mmap.mmap(-1, mapping_bytes(total), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages are chosen when first written
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` while any tensor uses it
    start = -whole.data_ptr() % HUGE
    storage = whole.untyped_storage()
    with torch.no_grad():
        for ptr, on in on_storage.items():
            old = on[0].untyped_storage()  # freed once its tensors below point elsewhere
            at = start + offsets[ptr]
            whole[at : at + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in on:  # the same bytes at the same offset, now in the mapping
                t.set_(storage, at // t.element_size() + t.storage_offset(), t.size(), t.stride())
            del old
    key = storage.data_ptr()
    _MAPPINGS.add(key)
    weakref.finalize(mapping, _MAPPINGS.discard, key)
    return total
