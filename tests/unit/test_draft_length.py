"""BASS's dynamic draft length (DESIGN §6), worked by hand."""
from __future__ import annotations

import pytest

from specstack.drafting.draft_length import DynamicDraftLength


def test_grows_by_two_when_a_row_accepts_everything_and_stops_at_the_cap():
    n = DynamicDraftLength(start=7, cap=12)
    assert n.value == 7
    assert n.update([7]) == 9
    assert n.update([0, 9]) == 11  # one row accepting all is enough
    assert n.update([11]) == 12  # capped
    assert n.update([12]) == 12


def test_shrinks_by_a_tenth_and_one_more_after_consecutive_misses():
    n = DynamicDraftLength(start=20, cap=32)
    assert n.update([3]) == 18  # 20 - ceil(2.0) - 0
    assert n.update([3]) == 15  # 18 - ceil(1.8) - 1
    assert n.update([3, 14]) == 14  # never below the longest accepted run
    assert n.update([14]) == 16  # all accepted: grow, and the extra shrink is forgotten
    assert n.update([0]) == 14  # 16 - ceil(1.6) - 0


def test_never_below_one_and_reset_restores_the_start():
    n = DynamicDraftLength(start=2, cap=4)
    assert n.update([0]) == 1
    assert n.update([0]) == 1
    assert n.update([]) == 1  # a step in which no row drafted
    n.reset()
    assert n.value == 2
    assert n.update([0]) == 1  # after reset, the first miss is not a consecutive one: 2 - 1 - 0


@pytest.mark.parametrize("start,cap", [(0, 4), (5, 4)])
def test_bad_bounds(start, cap):
    with pytest.raises(ValueError, match="start"):
        DynamicDraftLength(start=start, cap=cap)
