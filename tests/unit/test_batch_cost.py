"""engine/batch_cost.py: the cost of a target forward as a function of (rows, tokens), one row being
the verification width curve (`width_costs`).

Hand-made curves pin the arithmetic (interpolation in extras and in rows, extrapolation past the
grid, never cheaper for more); a counting stand-in for the measurement pins the laziness and the
store (only the grid row counts a cost needs are measured, once per machine; a damaged store is
measured again; the width curve is the one-row curve of the same store entry, measured at every
width asked for); a simulated clock pins the harness's order and median; the tiny model pins that a
real measurement is positive and non-decreasing."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specstack.engine import batch_cost
from specstack.engine.batch_cost import BatchCosts, RowCurve, extra_cap, extra_grid, grid_rows, spread, width_costs
from specstack.errors import SpecstackError


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
    # the one-row curve asked for a width curve: every integer up to it, then the same tail
    assert extra_grid(1, 8) == [*range(9), 12, 16] and extra_grid(1, 36) == list(range(37))
    assert extra_grid(1, 13) == [*range(14), 16]
    assert RowCurve.monotone(extra_grid(1, 8), [1.0] * 11).dense_to(8)
    assert not RowCurve.monotone(extra_grid(1), [1.0] * 9).dense_to(5)  # 0..4, 6: 5 is interpolated
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
        return RowCurve(tuple(extras), tuple(0.01 * rows + 0.001 * e for e in extras))

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


def test_curves_are_kept_per_kernel_path(tiny_llama, counted, monkeypatch):
    """A forward's time is its kernel path's (w4a8's wide512 against vnni512: several times at 16 rows)."""
    batch_cost.batch_costs(tiny_llama.lm).cost(1, 1)
    monkeypatch.setattr(batch_cost, "weights_label", lambda fmt, device: f"{fmt} (another kernels)")
    batch_cost.batch_costs(tiny_llama.lm).cost(1, 1)
    assert counted == [1, 1]


@pytest.mark.parametrize("change", ["kernels", "cpu"])
def test_curves_are_kept_per_kernel_source_and_cpu_family(tiny_llama, counted, monkeypatch, change):
    """A change to the kernels' code, or a CPU of another family under the same bare name (a virtual
    machine's "AMD EPYC" on a Zen 4 and a Zen 5), retires the curves measured before it."""
    batch_cost.batch_costs(tiny_llama.lm).cost(1, 1)
    if change == "kernels":
        monkeypatch.setattr(batch_cost.native, "sources_digest", lambda: "another source")
    else:
        monkeypatch.setattr(batch_cost, "cpu_model", lambda: "AMD EPYC (family 25 model 17)")
    batch_cost.batch_costs(tiny_llama.lm).cost(1, 1)
    assert counted == [1, 1]


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

    def recording(self, counts, layout, logits="last"):
        asked.append((list(counts), layout, logits))
        return ragged(self, counts, layout, logits)

    monkeypatch.setattr(batch_cost.RowForwards, "ragged", recording)
    got = batch_cost.measure_batch_costs(tiny_llama.lm, 3, [0, 5, 2], context=16, repeats=2, warmup=0)
    # every token's logits: a verify step needs them all, and their head is part of the cost
    assert sorted(asked) == [([1, 1, 1], "split", "all"), ([2, 2, 1], "split", "all"), ([3, 3, 2], "split", "all")]
    assert got.extras == (0, 2, 5) and all(s > 0 for s in got.seconds)
    assert list(got.seconds) == sorted(got.seconds)  # non-decreasing in extras, whatever order they came in
    with pytest.raises(ValueError, match="rows >= 1"):
        batch_cost.measure_batch_costs(tiny_llama.lm, 0, [0])


def test_a_real_one_row_cost_is_positive_and_non_decreasing(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    costs = batch_cost.batch_costs(tiny_llama.lm, context=32, repeats=1)
    seq = [costs.cost(1, t) for t in range(1, 80)]  # past the grid's end (64 extras) too
    assert all(s > 0 for s in seq) and seq == sorted(seq)
    assert list(costs.curves) == [1]


# ---------------------------------------------------------------------------------------------------
# The harness on a simulated clock
# ---------------------------------------------------------------------------------------------------
def simulate(monkeypatch, seconds) -> list[int]:
    """RowForwards replaced by forwards that advance a fake clock by seconds(tokens, previous tokens);
    returns the tokens of every forward, in the order they ran."""
    clock, order = [0.0], []

    class Forwards:
        def __init__(self, lm, ctx, rows, scratch):
            pass

        def ragged(self, counts, layout, logits="last"):
            def step(tokens):
                clock[0] += seconds(sum(counts), order[-1] if order else None)
                order.append(sum(counts))
            return step

    monkeypatch.setattr(batch_cost, "RowForwards", Forwards)
    monkeypatch.setattr(batch_cost, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return order


def test_each_width_is_timed_in_a_new_order_every_round(tiny_llama, monkeypatch):
    """On the CPU a forward right after the widest one runs slow. Timed in a fixed order, that always
    hit T = 1 and made T = 2..4 look as cheap as one token. On a simulated clock where a forward costs
    its width, plus 10 right after the widest, each width's median must be its own cost."""
    widths = 6
    order = simulate(monkeypatch, lambda t, before: t + (10.0 if before == widths else 0.0))
    costs = batch_cost.measure_batch_costs(tiny_llama.lm, 1, range(widths), repeats=5)
    assert costs.seconds == tuple(float(t) for t in range(1, widths + 1))
    rounds = [order[i:i + widths] for i in range(0, len(order), widths)]
    assert len(rounds) == 6 and all(sorted(r) == list(range(1, widths + 1)) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds


def test_a_wider_forward_measured_cheaper_is_raised_to_the_narrower(tiny_llama, monkeypatch):
    simulate(monkeypatch, lambda t, before: {3: 0.5}.get(t, float(t)))
    costs = batch_cost.measure_batch_costs(tiny_llama.lm, 1, range(5), repeats=1)
    assert costs.seconds == (1.0, 2.0, 2.0, 4.0, 5.0)


# ---------------------------------------------------------------------------------------------------
# The width curve: the one-row curve of the same store entry, every width measured
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def stepped(monkeypatch, tmp_path):
    """The measurement replaced by a stand-in whose cost is a step function of the tokens (blocks of
    four, as int4 kernels give); the store in a fresh cache directory. Yields the measured (rows,
    extras) pairs."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    calls: list[tuple[int, list[int]]] = []

    def fake(lm, rows, extras, context=256, repeats=3, warmup=1):
        calls.append((rows, list(extras)))
        return RowCurve(tuple(extras), tuple(float(rows + (rows + e - 1) // 4) for e in extras))

    monkeypatch.setattr(batch_cost, "measure_batch_costs", fake)
    return calls


def test_the_width_curve_and_the_one_row_costs_are_one_store_entry(tiny_llama, stepped, tmp_path):
    widths = width_costs(tiny_llama.lm, 9)
    # every width measured: the steps come through exactly (interpolating 6 and 8 would give 7 = 2.5)
    assert widths == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0]
    assert stepped == [(1, [*range(9), 12, 16])]
    costs = batch_cost.batch_costs(tiny_llama.lm)  # a new process
    assert [costs.cost(1, t) for t in range(1, 10)] == widths
    assert width_costs(tiny_llama.lm, 9) == widths and width_costs(tiny_llama.lm, 4) == widths[:4]
    assert len(stepped) == 1  # a second call, narrower or as wide, measures nothing
    store = json.loads((tmp_path / batch_cost.STORE_NAME).read_text(encoding="utf-8"))
    assert [list(entry) for entry in store.values()] == [["1"]]  # one key, one one-row curve


def test_one_row_costs_then_a_wider_width_curve_measures_again(tiny_llama, stepped):
    costs = batch_cost.batch_costs(tiny_llama.lm)
    costs.cost(1, 1)
    assert stepped == [(1, extra_grid(1))]  # the lean grid: 0..4 dense
    assert width_costs(tiny_llama.lm, 5) == [1.0] * 4 + [2.0] and len(stepped) == 1  # served by 0..4
    assert width_costs(tiny_llama.lm, 20)[-1] == 5.0  # wider than measured: measured again, and kept
    assert stepped[1] == (1, list(range(20)))
    assert width_costs(tiny_llama.lm, 12) == [1.0 + (t - 1) // 4 for t in range(1, 13)] and len(stepped) == 2
    assert batch_cost.batch_costs(tiny_llama.lm).cost(1, 20) == 5.0 and len(stepped) == 2


def test_width_costs_are_measured_once_then_read_from_the_store(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    calls: list[int] = []  # the widths each measurement covered at every T
    real = batch_cost.measure_batch_costs

    def counted(lm, rows, extras, **kw):
        calls.append(next(t for t in range(len(extras) + 1) if t == len(extras) or extras[t] != t))
        return real(lm, rows, extras, context=32, repeats=1)

    monkeypatch.setattr(batch_cost, "measure_batch_costs", counted)
    first = width_costs(tiny_llama.lm, 5)
    assert calls == [5] and len(first) == 5 and first == sorted(first) and all(c > 0 for c in first)
    assert (tmp_path / batch_cost.STORE_NAME).is_file()
    assert width_costs(tiny_llama.lm, 5) == first  # from the store
    assert width_costs(tiny_llama.lm, 3) == first[:3]  # a narrower request: the prefix
    assert calls == [5]
    wider = width_costs(tiny_llama.lm, 7)  # wider than stored: measured again, and kept
    assert calls == [5, 7] and len(wider) == 7
    assert width_costs(tiny_llama.lm, 6) == wider[:6] and calls == [5, 7]
    # another thread count is another curve (never narrower than T = 1..5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        width_costs(tiny_llama.lm, 2)
    finally:
        torch.set_num_threads(threads)
    assert calls == [5, 7, 5]
    # a damaged store is measured again and rewritten whole
    (tmp_path / batch_cost.STORE_NAME).write_text("{not json", encoding="utf-8")
    assert len(width_costs(tiny_llama.lm, 4)) == 4 and calls == [5, 7, 5, 5]
    assert width_costs(tiny_llama.lm, 4) and calls == [5, 7, 5, 5]
    with pytest.raises(ValueError, match="widths"):
        width_costs(tiny_llama.lm, 0)


def test_measured_width_costs_cover_each_width_and_never_fall(tiny_llama, monkeypatch, tmp_path):
    costs = batch_cost.measure_batch_costs(tiny_llama.lm, 1, range(6), context=32, repeats=2)
    assert costs.extras == tuple(range(6))
    assert all(c > 0 for c in costs.seconds)
    assert list(costs.seconds) == sorted(costs.seconds)
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    n = tiny_llama.lm.config.max_seq_len  # n tokens after one of context: one past the model's positions
    with pytest.raises(SpecstackError, match="does not fit"):
        width_costs(tiny_llama.lm, n)
