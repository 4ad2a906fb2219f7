"""Tumbling step windows: closing, statistics against numpy, NaN handling, splits, late points, state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rankwatch.contract import Rollup
from rankwatch.sketch import Sketch
from rankwatch.stream_processors.windows import Window, roll


def _stats_match(w: Window, points: np.ndarray, width: int, *, rel: float = 1e-9) -> None:
    finite = points[np.isfinite(points)]
    r = w.to_rollup(run="r", rank=0, metric="m", width=width, now=1.0)
    assert r.count == len(finite)
    assert r.nonfinite == len(points) - len(finite)
    assert r.mean == pytest.approx(finite.mean(), rel=1e-12, abs=1e-12)
    # The rollup's std is the sample standard deviation (ddof=1).
    assert r.std == pytest.approx(finite.std(ddof=1), rel=rel, abs=1e-12)
    assert r.min == finite.min() and r.max == finite.max()
    assert (r.start_step, r.end_step) == (w.index * width, (w.index + 1) * width)


def _feed(steps: np.ndarray, values: np.ndarray, width: int, block: int):
    window, closed = None, []
    for lo in range(0, len(steps), block):
        window, c = roll(window, steps[lo : lo + block], values[lo : lo + block], width)
        closed += c
    return window, closed


def test_a_window_closes_only_when_a_later_windows_point_arrives():
    w, closed = roll(None, np.arange(0, 10), np.ones(10), 10)
    assert closed == [] and w.index == 0 and w.count == 10
    w, closed = roll(w, np.array([10]), np.array([5.0]), 10)
    assert [c.index for c in closed] == [0]
    assert closed[0].count == 10 and w.index == 1 and w.count == 1


def test_skipping_windows_closes_only_the_open_one():
    w, _ = roll(None, np.array([3, 4]), np.array([1.0, 2.0]), 10)
    w, closed = roll(w, np.array([57]), np.array([3.0]), 10)
    assert [c.index for c in closed] == [0]
    assert w.index == 5


def test_empty_input_changes_nothing():
    w, _ = roll(None, np.array([1]), np.array([1.0]), 10)
    before = w.to_dict()
    w2, closed = roll(w, np.array([], dtype=np.int64), np.array([]), 10)
    assert w2 is w and closed == [] and w2.to_dict() == before
    assert roll(None, np.array([], dtype=np.int64), np.array([]), 10) == (None, [])


@pytest.mark.parametrize("block", [1, 7, 50, 1000])
def test_stats_equal_numpys_whatever_the_batching(block):
    rng = np.random.default_rng(0)
    width = 50
    steps = np.arange(1000, 1400)
    values = rng.normal(3.0, 2.0, len(steps)) * rng.choice([1.0, 100.0], len(steps))
    window, closed = _feed(steps, values, width, block)
    assert [w.index for w in closed] == list(range(20, 27))
    for w in closed + [window]:
        in_window = values[(steps // width) == w.index]
        _stats_match(w, in_window, width)
        assert w.last == in_window[-1]


def test_stats_are_stable_for_large_offsets():
    # A naive sum-of-squares variance loses every digit here (E[x^2] - E[x]^2 ~ 1e18 - 1e18);
    # Chan's merge keeps the std to a few parts per million.
    rng = np.random.default_rng(1)
    values = 1e9 + rng.normal(0.0, 1e-3, 100)
    w, _ = _feed(np.arange(100), values, 100, 9)
    _stats_match(w, values, 100, rel=1e-5)


def test_nans_and_infs_are_counted_and_excluded_from_stats():
    values = np.array([1.0, np.nan, 3.0, np.inf, 5.0, -np.inf, np.nan])
    w, _ = roll(None, np.arange(7), values, 10)
    assert w.count == 4 - 1 and w.nonfinite == 4
    _stats_match(w, values, 10)
    assert math.isnan(w.last)  # last is the last point seen, finite or not


def test_a_window_of_only_nans_rolls_up_as_empty():
    w, _ = roll(None, np.arange(3), np.full(3, np.nan), 10)
    r = w.to_rollup(run="r", rank=1, metric="loss", width=10, now=2.0)
    assert (r.count, r.nonfinite, r.std) == (0, 3, 0.0)
    assert math.isnan(r.mean) and math.isnan(r.min) and math.isnan(r.max) and math.isnan(r.last)


def test_single_point_window_has_zero_std():
    w, _ = roll(None, np.array([5]), np.array([2.5]), 10)
    r = w.to_rollup(run="r", rank=0, metric="m", width=10, now=0.0)
    assert (r.count, r.mean, r.std, r.min, r.max, r.last) == (1, 2.5, 0.0, 2.5, 2.5, 2.5)


def test_a_block_spanning_several_windows_splits_correctly():
    steps = np.arange(5, 47)  # windows 0..4 of width 10
    values = steps.astype(float) * 1.5
    w, closed = roll(None, steps, values, 10)
    assert [c.index for c in closed] == [0, 1, 2, 3]
    assert [c.count for c in closed] == [5, 10, 10, 10]
    assert w.index == 4 and w.count == 7
    for c in closed + [w]:
        _stats_match(c, values[steps // 10 == c.index], 10)


def test_late_points_of_a_closed_window_are_ignored():
    w, closed = roll(None, np.arange(0, 25), np.ones(25), 10)
    assert w.index == 2 and [c.index for c in closed] == [0, 1]
    before = w.to_dict()
    w, closed = roll(w, np.array([3, 15]), np.array([100.0, 100.0]), 10)
    assert closed == [] and w.to_dict() == before


def test_late_points_then_current_points_in_one_block():
    w, _ = roll(None, np.arange(20, 25), np.ones(5), 10)
    w, closed = roll(w, np.array([12, 13, 26, 27]), np.array([50.0, 50.0, 3.0, 5.0]), 10)
    assert closed == [] and w.index == 2
    _stats_match(w, np.array([1, 1, 1, 1, 1, 3.0, 5.0]), 10)


def test_window_dict_round_trip_including_inf_and_nan():
    fresh = Window(index=4)  # min=inf, max=-inf, last=nan
    d = fresh.to_dict()
    text = json.dumps(d, allow_nan=False)  # strict JSON: no bare NaN/Infinity
    back = Window.from_dict(json.loads(text))
    assert back.index == 4 and back.count == 0
    assert back.min == math.inf and back.max == -math.inf and math.isnan(back.last)


def test_window_dict_round_trip_continues_identically():
    w, _ = roll(None, np.arange(10, 16), np.array([1.0, np.nan, 2.5, -3.0, np.inf, 0.25]), 10)
    back = Window.from_dict(json.loads(json.dumps(w.to_dict(), allow_nan=False)))
    assert back == w
    more_steps, more_values = np.arange(16, 25), np.linspace(-1.0, 1.0, 9)
    a, ca = roll(w, more_steps, more_values, 10)
    b, cb = roll(back, more_steps, more_values, 10)
    assert a.to_dict() == b.to_dict() and [c.to_dict() for c in ca] == [c.to_dict() for c in cb]


def test_rollup_of_a_closed_window_is_wire_ready():
    w, _ = roll(None, np.arange(50, 60), np.arange(10, dtype=float), 50)
    r = w.to_rollup(run="run-9", rank=3, metric="loss", width=50, now=7.0)
    assert (r.run, r.rank, r.metric, r.start_step, r.end_step, r.ts) == ("run-9", 3, "loss", 50, 100, 7.0)
    assert Rollup.from_bytes(r.to_bytes()) == r


def test_one_point_at_a_time_gives_the_same_statistics_as_one_block():
    rng = np.random.default_rng(3)
    values = rng.normal(5.0, 2.0, 40)
    values[[7, 19]] = [np.nan, np.inf]
    one = Window(index=0)
    for v in values:
        one.add(np.array([v]))
    block = Window(index=0)
    block.add(values)
    finite = values[np.isfinite(values)]
    for w in (one, block):
        assert (w.count, w.nonfinite) == (38, 2)
        assert w.mean == pytest.approx(finite.mean()) and w.m2 == pytest.approx(((finite - finite.mean()) ** 2).sum())
        assert (w.min, w.max) == (finite.min(), finite.max()) and w.last == values[-1]


def test_a_window_keeps_its_points_up_to_a_digest_s_size_then_a_digest():
    rng = np.random.default_rng(11)
    values = rng.lognormal(size=130)
    for upto in (100, 130):
        one, block = Window(index=0), Window(index=0)
        for step, v in enumerate(values[:upto]):
            one.add_one(step, float(v))
        block.add(values[:60], np.arange(60))
        block.add(values[60:upto], np.arange(60, upto))
        if upto == 100:  # exact: the rollup's digest is the one of every point
            assert one.sketch is None and one.points == block.points == values[:100].tolist()
            every = Sketch.of(values[:100])
        for w in (one, block):
            r = w.to_rollup(run="r", rank=0, metric="m", width=200, now=0.0)
            assert Sketch.from_wire(r.sketch).count == upto
            if upto == 100:
                assert r.sketch == every.to_wire() and (r.p50, r.p95, r.p99) == every.quantiles()
            else:  # past it, a digest: close, as the digest's own were before
                assert r.p50 == pytest.approx(np.quantile(values, 0.5), rel=0.02)
                assert r.p95 == pytest.approx(np.quantile(values, 0.95), rel=0.05)


def test_a_window_stored_with_a_sketch_reads_back_and_goes_on():
    w, _ = roll(None, np.arange(10), np.arange(10, dtype=float), 50)
    old = {**{k: v for k, v in w.to_dict().items() if k != "points"}, "sketch": Sketch.of(w.points).to_wire()}
    back = Window.from_dict(old)
    back.add_one(10, 10.0)
    w.add_one(10, 10.0)
    assert back.to_rollup(run="r", rank=0, metric="m", width=50, now=0.0) == \
        w.to_rollup(run="r", rank=0, metric="m", width=50, now=0.0)
