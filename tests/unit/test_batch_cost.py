"""engine/batch_cost.py: the cost of a batched target forward as a function of (rows, tokens).

Hand-made curves pin the arithmetic (interpolation in extras and in rows, extrapolation past the
grid, never cheaper for more); a counting stand-in for the measurement pins the laziness and the
store (only the grid row counts a cost needs are measured, once per machine; a damaged store is
measured again); the tiny model pins that a real measurement is positive and non-decreasing."""
from __future__ import annotations

import json

import pytest

from specstack.engine import batch_cost
from specstack.engine.batch_cost import BatchCosts, RowCurve, extra_cap, extra_grid, grid_rows, spread


def curve(points: dict[int, float]) -> RowCurve:
    return RowCurve(tuple(points), tuple(points.values()))


# ---------------------------------------------------------------------------------------------------
# Arithmetic on known curves
# ---------------------------------------------------------------------------------------------------
def test_a_curve_interpolates_in_extras_and_extrapolates_with_its_last_slope():
    c = curve({0: 1.0, 1: 2.0, 2: 2.0, 4: 4.0})
    assert c.at(0) == 1.0 and c.at(4) == 4.0
    assert c.at(0.5) == pytest.approx(1.5)
    assert c.at(3) == pytest.approx(3.0)  # halfway from 2 (2.0) to 4 (4.0)
    assert c.at(6) == pytest.approx(6.0)  # past the end: slope 1 a token
    flat = curve({0: 1.0, 8: 3.0, 12: 3.0})
    assert flat.at(100) == 3.0  # a flat last stretch stays flat, never below the last value
    assert curve({0: 2.0}).at(50) == 2.0  # one point: constant


def test_a_measured_curve_is_made_non_decreasing_and_bad_curves_are_refused():
    assert RowCurve.monotone([0, 1, 2, 3], [2.0, 1.5, 3.0, 2.5]).seconds == (2.0, 2.0, 3.0, 3.0)
    with pytest.raises(ValueError, match="increasing"):
        RowCurve((0, 2, 2), (1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="positive"):
        RowCurve((0, 1), (1.0, 0.0))
    with pytest.raises(ValueError, match="as many seconds"):
        RowCurve((0, 1), (1.0,))


def test_cost_interpolates_between_row_counts_at_the_same_extras():
    costs = BatchCosts({1: curve({0: 1.0, 4: 2.0}), 4: curve({0: 4.0, 4: 8.0})})
    assert costs.cost(1, 1) == 1.0 and costs.cost(4, 8) == 8.0  # on the grid: the curve itself
    assert costs.cost(1, 3) == pytest.approx(1.5)  # 2 extras, halfway along the 1-row curve
    # 2 rows, 2 extras: a third of the way from 1 row (1.5) to 4 rows (6.0)
    assert costs.cost(2, 4) == pytest.approx(1.5 + (6.0 - 1.5) / 3)
    assert costs.cost(4, 12) == pytest.approx(12.0)  # 8 extras: past the grid's 4, slope 1 a token
    with pytest.raises(ValueError, match="no curve"):
        costs.cost(8, 8)  # nothing measured at or above 8 rows, and nothing to measure with
    with pytest.raises(ValueError, match="tokens >= rows"):
        costs.cost(3, 2)


def test_more_rows_never_cost_less_and_more_tokens_never_cost_less():
    """A noisy 4-row curve below the 2-row one does not make 3 rows cheaper than 2."""
    costs = BatchCosts({2: curve({0: 2.0, 8: 4.0}), 4: curve({0: 1.5, 8: 5.0})})
    for extra in range(0, 20):
        assert costs.cost(3, 3 + extra) >= costs.cost(2, 2 + extra)
    for rows in (2, 3, 4):
        seq = [costs.cost(rows, rows + e) for e in range(0, 40)]
        assert seq == sorted(seq)


def test_the_grid():
    assert grid_rows(1) == (1, 1) and grid_rows(8) == (8, 8) and grid_rows(12) == (8, 16) and grid_rows(3) == (2, 4)
    for rows in (1, 2, 16, 64):
        g = extra_grid(rows)
        assert g[:5] == list(range(5)) and g == sorted(set(g)) and g[-1] == extra_cap(rows)
    assert extra_grid(1)[5:] == [6, 8, 12, 16] and extra_cap(64) == 128
    assert spread(3, 5) == [3, 3, 2] and spread(4, 0) == [1] * 4 and sum(spread(5, 17)) == 22


# ---------------------------------------------------------------------------------------------------
# Lazy measurement and the store
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The measurement replaced by a counting stand-in (0.01 s a row plus 0.001 s an extra); the store
    in a fresh cache directory. Yields the list of measured row counts."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    calls: list[int] = []

    def fake(lm, rows, extras, context=256, repeats=3, warmup=1):
        calls.append(rows)
        return [0.01 * rows + 0.001 * e for e in extras]

    monkeypatch.setattr(batch_cost, "measure_batch_costs", fake)
    return calls


def test_only_the_row_counts_a_cost_needs_are_measured_and_then_read_from_the_store(tiny_llama, counted, tmp_path):
    costs = batch_cost.batch_costs(tiny_llama.lm)
    assert counted == []  # nothing measured until a cost is asked for
    value = costs.cost(3, 5)
    assert sorted(counted) == [2, 4]  # the grid row counts around 3, not 1, 8, 16, ...
    assert value == pytest.approx(0.03 + 0.002)  # linear in rows between 2 and 4, at 2 extras
    costs.cost(4, 20)
    costs.cost(2, 2)
    assert sorted(counted) == [2, 4]  # already known
    costs.cost(1, 9)
    assert sorted(counted) == [1, 2, 4]
    assert (tmp_path / batch_cost.STORE_NAME).is_file()
    again = batch_cost.batch_costs(tiny_llama.lm)  # a new process: the store, no measuring
    assert again.cost(3, 5) == value and again.cost(1, 9) == costs.cost(1, 9)
    assert sorted(counted) == [1, 2, 4]
    again.cost(16, 16)  # a row count no process measured yet
    assert sorted(counted) == [1, 2, 4, 16]


def test_a_damaged_store_or_curve_is_measured_again(tiny_llama, counted, tmp_path):
    batch_cost.batch_costs(tiny_llama.lm).cost(2, 2)
    path = tmp_path / batch_cost.STORE_NAME
    path.write_text("{not json", encoding="utf-8")
    batch_cost.batch_costs(tiny_llama.lm).cost(2, 2)
    assert counted == [2, 2]
    store = json.loads(path.read_text(encoding="utf-8"))  # rewritten whole
    (key,) = store
    store[key]["4"] = {"extras": [0, 1], "seconds": [0.1, -1.0]}  # a curve no measurement gives
    path.write_text(json.dumps(store), encoding="utf-8")
    batch_cost.batch_costs(tiny_llama.lm).cost(3, 3)  # rows 2 from the store, rows 4 measured again
    assert counted == [2, 2, 4]


def test_curves_are_kept_per_context(tiny_llama, counted):
    batch_cost.batch_costs(tiny_llama.lm, context=64).cost(1, 1)
    batch_cost.batch_costs(tiny_llama.lm, context=128).cost(1, 1)
    batch_cost.batch_costs(tiny_llama.lm, context=64).cost(1, 1)
    assert counted == [1, 1]


# ---------------------------------------------------------------------------------------------------
# A real measurement on the tiny model
# ---------------------------------------------------------------------------------------------------
def test_a_measurement_times_split_forwards_with_the_extras_spread_as_chains(tiny_llama, monkeypatch):
    asked: list[tuple[list[int], str]] = []
    ragged = batch_cost.RowForwards.ragged

    def recording(self, counts, layout):
        asked.append((list(counts), layout))
        return ragged(self, counts, layout)

    monkeypatch.setattr(batch_cost.RowForwards, "ragged", recording)
    got = batch_cost.measure_batch_costs(tiny_llama.lm, 3, [0, 5, 2], context=16, repeats=2, warmup=0)
    assert asked == [([1, 1, 1], "split"), ([3, 3, 2], "split"), ([2, 2, 1], "split")]
    assert len(got) == 3 and all(s > 0 for s in got)
    assert got[0] <= got[2] <= got[1]  # non-decreasing in extras, whatever order they came in
    with pytest.raises(ValueError, match="rows >= 1"):
        batch_cost.measure_batch_costs(tiny_llama.lm, 0, [0])


def test_a_real_one_row_cost_is_positive_and_non_decreasing(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    costs = batch_cost.batch_costs(tiny_llama.lm, context=32, repeats=1)
    seq = [costs.cost(1, t) for t in range(1, 80)]  # past the grid's end (64 extras) too
    assert all(s > 0 for s in seq) and seq == sorted(seq)
    assert list(costs.curves) == [1]
