"""Vectorised updates give what point-by-point updates give (issue 16).

The stream feeds a detector a batch of consecutive points of one series; ``update`` promises the
scores and state of feeding them one at a time. For each detector whose ``update`` works on a
batch with numpy calls over arrays (the tail model's ``update_many``, ``spike`` and ``blowup`` on
top of it), the same series fed one point at a time and in batches of several sizes must agree:
scores within float tolerance, the same decisions, the same state (one point at a time takes the
plain-Python path of ``spike`` and ``blowup``, batches the arrays). On generated series (noise,
bursts, shifts, spikes, NaNs, infinities) and on the recorded ones in ``bench/data``.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from rankwatch.stream_processors.detectors import Blowup, RobustSpike
from rankwatch.stream_processors.detectors.calibration import REFIT, TailModel, fit_due, half_normal_sf, prior_counts

DATA = Path(__file__).resolve().parents[1] / "bench" / "data"
BATCHES = (3, 64, 1000)
#: Points per series: enough for the period check (every 64), level changes and a refilled memory.
LENGTH = 1000


def _generated() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    n = LENGTH
    t = np.arange(n)
    return {
        "noise": 1.0 + 0.01 * rng.normal(size=n),
        "trending": 5.0 * np.exp(-t / 800) + 0.01 * rng.normal(size=n),
        "bursty": np.where(rng.random(n) < 0.05, 3.0, 1.0) * rng.lognormal(0, 0.1, n),
        "seasonal": 2.0 + np.sin(t * 2 * np.pi / 50) + rng.normal(0, 0.3, n),
        "shift": np.r_[rng.normal(5, 1, n // 2), rng.normal(25, 1, n - n // 2)],
        "spikes": np.where(rng.random(n) < 0.01, 50.0, 1.0) + rng.normal(0, 0.1, n),
        "flat_then_step": np.r_[np.full(300, 3.0), np.full(300, 30.0), rng.normal(30, 1, n - 600)],
        # a gauge read to 0.1 that mostly holds still: the resolution floor, its ties and its expiry
        "quantised": np.round(20.0 + np.cumsum(rng.normal(0, 0.02, n)) + np.where(rng.random(n) < 0.1, 0.1, 0.0), 1),
        "nan_and_inf": np.where(rng.random(n) < 0.03, np.nan, np.where(rng.random(n) < 0.005, 1e308 * 10,
                                                                        rng.normal(3, 1, n))),
    }


def _recorded() -> dict[str, np.ndarray]:
    """Labelled series with spikes, shifts and blow-ups, and the loss and grad norm of a real run."""
    out = {}
    for name in ("counts_s0_burst", "daily_s1_spike", "grad_norm_s2_spike-blowup", "memory_s1_shift_up",
                 "loss_s1_spike-shift_up", "real_co2"):
        path = DATA / "corpus" / "tune" / f"{name}.csv"
        if path.exists():
            with path.open() as f:
                out[name] = np.array([float(row["value"]) for row in csv.DictReader(f)])[-LENGTH:]
    run = DATA / "corpus_runs" / "clean2r_s0" / "rank0.bin"
    if run.exists():
        sys.path.insert(0, str(DATA.parent))
        from scenario_runs import read_batches

        batches = read_batches(run)
        for metric in ("loss", "grad_norm"):
            out[f"run_{metric}"] = np.concatenate([b.series[metric].values for b in batches if metric in b.series])
    return out


SERIES = {**_generated(), **_recorded()}


def _one_at_a_time(detector, x: np.ndarray) -> np.ndarray:
    return np.concatenate([detector.update(x[i : i + 1]) for i in range(len(x))])


def _in_batches(detector, x: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([detector.update(x[i : i + size]) for i in range(0, len(x), size)])


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        left, right = a[key], b[key]
        if key == "calib":
            np.testing.assert_allclose(left[0], right[0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(left[1], right[1], rtol=1e-12, atol=1e-12)
        elif key == "history":
            np.testing.assert_allclose(left, right, rtol=1e-12, atol=1e-12)
        else:
            assert left == right, key


DETECTORS = {
    "spike": lambda: RobustSpike(),
    "spike_down_small": lambda: RobustSpike(window=16, warmup=8, direction="down", max_period=20, rebase=3),
    "spike_low_threshold": lambda: RobustSpike(threshold=0.99),  # many points beyond: the clipped path
    "spike_tail_both": lambda: RobustSpike(tail=0.9),  # the tail's order statistics on both sides
    "spike_min_run": lambda: RobustSpike(direction="down", min_run=3),  # runs too short to be news
    "blowup": lambda: Blowup(),
}


@pytest.mark.parametrize("series", sorted(SERIES))
@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_a_batch_update_is_the_point_by_point_update(name, series):
    x = SERIES[series]
    if name == "blowup":
        x = np.abs(x) + 0.01
    reference = DETECTORS[name]()
    expected = _one_at_a_time(reference, x)
    for size in BATCHES:
        d = DETECTORS[name]()
        got = _in_batches(d, x, size)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12, err_msg=f"batches of {size}")
        assert np.array_equal(d.decide(got), reference.decide(expected)), f"batches of {size}"
        _same_state(d.state_dict(), reference.state_dict())


def _usual(shape: str) -> np.ndarray:
    rng, t = np.random.default_rng(5), np.arange(1200)
    noise = 0.01 * rng.normal(size=len(t))
    if shape == "trending":  # a loss on its way down
        return 5.0 * np.exp(-t / 800) + noise
    if shape == "periodic":  # an evaluation pause every 50 steps
        return 1.0 + np.where(t % 50 == 0, 0.3, 0.0) + noise
    return 1.0 + noise


@pytest.mark.parametrize(("name", "shape"), [
    ("spike", "noise"), ("spike_tail_both", "noise"), ("blowup", "noise"),
    ("spike", "trending"), ("spike", "periodic"), ("spike_tail_both", "periodic"),
])
def test_the_one_point_path_takes_the_usual_point(name, shape):
    # The tests above compare it with the array path only if points one at a time take it: a warm
    # detector past its warm-up must answer nearly every point there, on plain noise, on a series
    # it follows with its line, and on one it judges against its period.
    d = DETECTORS[name]()
    x = _usual(shape)
    d.update(x[:600])
    assert (d.trending, bool(d.period)) == (shape == "trending", shape == "periodic")
    taken = [d._update_one(float(v)) is not None for v in x[600:]]
    assert sum(taken) >= 0.9 * len(taken)


@pytest.mark.parametrize("threshold", [0.5, 0.99, 0.999999])
@pytest.mark.parametrize("pending", [0, 3, REFIT])
def test_tail_model_update_many_is_update_in_turn(threshold, pending):
    rng = np.random.default_rng(int(threshold * 1000) + pending)
    s = np.abs(rng.standard_t(3, 2000))
    s[rng.random(len(s)) < 0.01] = math.inf
    s[rng.random(len(s)) < 0.02] = 0.0
    s[rng.random(len(s)) < 0.005] = 1e6  # beyond the histogram
    start = rng.exponential(1.0, pending).tolist()
    one = TailModel(prior_counts(half_normal_sf, 50.0), start, memory=200)
    expected = np.array([one.update(v, threshold) for v in s.tolist()])
    for size in (1, REFIT, 13, 64, len(s)):
        many = TailModel(prior_counts(half_normal_sf, 50.0), start, memory=200)
        got = np.concatenate([many.update_many(s[i : i + size], threshold) for i in range(0, len(s), size)])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12, err_msg=f"batches of {size}")
        np.testing.assert_allclose(many.state()[0], one.state()[0], rtol=1e-12)
        assert many.state()[1] == pytest.approx(one.state()[1], rel=1e-12)
    assert (expected >= threshold).any(), "some values go beyond the threshold: the clipped path is covered"


def test_tail_model_values_not_to_learn_are_scored_and_skipped():
    rng = np.random.default_rng(5)
    s = np.abs(rng.standard_t(3, 500))
    s[rng.random(len(s)) < 0.005] = 1e6
    learn = rng.random(len(s)) < 0.8
    one = TailModel(prior_counts(half_normal_sf, 50.0), memory=200)
    expected = np.array([one.update(v, 0.999) if keep else one.score(v) for v, keep in zip(s.tolist(), learn)])
    many = TailModel(prior_counts(half_normal_sf, 50.0), memory=200)
    got, probed = many.update_probed(s, 0.999, 4.0, learn)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(many.state()[0], one.state()[0], rtol=1e-12)
    assert many.state()[1] == pytest.approx(one.state()[1], rel=1e-12)
    assert probed.shape == s.shape and ((probed > 0) & (probed < 1)).all()


def test_tail_model_scores_alike_one_value_or_many():
    model = TailModel(prior_counts(half_normal_sf, 50.0))
    s = np.r_[0.0, -1.0, np.nan, 0.3, 1.0, 2.5, 4.0, 9.0, 50.0, 1e4, 1e6, math.inf]
    fitted = model._fit_row
    from rankwatch.stream_processors.detectors.calibration import survival_rows

    rows = np.zeros(len(s), dtype=np.int64)
    np.testing.assert_allclose(survival_rows(s, *(p[rows] for p in fitted)), [model.survival(v) for v in s.tolist()],
                               rtol=1e-12, atol=1e-15)


def test_tail_models_fitted_together_score_and_store_as_fitted_alone():
    """``fit_due`` only moves the fits: models learning one point at a time, fitted together after
    each round, score, fit and store exactly what the same models fitted on their own do."""
    rng = np.random.default_rng(4)
    memories = (20, 50, 200, 1000, 1000)
    alone = [TailModel(prior_counts(half_normal_sf, 50.0), memory=m) for m in memories]
    together = [TailModel(prior_counts(half_normal_sf, 50.0), memory=m) for m in memories]
    threshold = 0.999
    for step in range(5 * REFIT):  # the last step makes every fit due
        s = np.abs(rng.standard_t(3, len(memories))) * (1 + 3 * (step % 11 == 0))
        got = [model.update(v, threshold) for model, v in zip(together, s.tolist())]
        assert got == [model.update(v, threshold) for model, v in zip(alone, s.tolist())]
        if step % 3:  # on the other steps the due models fit themselves when next read
            fit_due(together[1:])
    assert any(model.due for model in together), "some fits were still due at the end: both paths covered"
    fit_due(together)
    for a, b in zip(alone, together):
        a.survival(1.0)  # fits a model still due
        assert a.state() == b.state()
        assert all(np.array_equal(x, y) for x, y in zip(a._fit_row, b._fit_row))


@pytest.mark.parametrize("n", [2, 3, 8, 63, 64])
def test_mad_sigma_selects_the_same_middle_as_sorting_every_deviation(n):
    # The one-point path's MAD bisects two sorted runs instead of sorting; ties (a quantised gauge)
    # and a centre away from the values' median (the phase's residuals) are where a bisection slips.
    from rankwatch.stream_processors.detectors.scoring import MAD_TO_SIGMA, mad_sigma, median_rows

    rng = np.random.default_rng(n)
    for values in (rng.normal(size=(200, n)), rng.integers(0, 3, size=(200, n)).astype(float)):
        for row in values:
            ordered = sorted(row.tolist())
            for centre in (None, float(row[0]), float(row.max()) + 1.0):
                m = np.median(row) if centre is None else centre
                want = median_rows(np.abs(row - m)[None, :])[0] / MAD_TO_SIGMA
                assert mad_sigma(ordered, centre) == want
