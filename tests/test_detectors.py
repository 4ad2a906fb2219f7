"""Detectors: every class in ``detectors.__all__`` against every conformance check, then specifics."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from conformance import CHECKS, Data

from rankwatch.stream_processors import detectors
from rankwatch.stream_processors.detectors import (
    Blowup,
    Collapse,
    CrossRank,
    Cusum,
    Ensemble,
    EwmaResidual,
    Explode,
    NonFinite,
    PageHinkley,
    Plateau,
    RobustSpike,
    Stall,
    Trend,
)

_rng = np.random.default_rng(12345)


def _noise(n: int = 200) -> np.ndarray:
    return _rng.normal(1.0, 0.01, n)


#: How to build each detector for the conformance checks, and data it must handle.
CASES = {
    NonFinite: (lambda: NonFinite(), Data(normal=_rng.normal(0.0, 1.0, 200), spike=np.nan)),
    RobustSpike: (lambda: RobustSpike(window=32, warmup=16), Data(normal=_noise(), spike=5.0)),
    EwmaResidual: (lambda: EwmaResidual(warmup=16), Data(normal=_noise(), spike=5.0)),
    # A clip above the spike's z lets one point alarm, so the checks see a decided spike.
    Cusum: (lambda: Cusum(window=32, warmup=16, clip=1e4), Data(normal=_noise(), spike=5.0)),
    PageHinkley: (lambda: PageHinkley(window=32, warmup=16, clip=1e4), Data(normal=_noise(), spike=5.0)),
    Trend: (lambda: Trend(window=24, warmup=12, direction="both"), Data(normal=_noise(120), spike=5.0)),
    Plateau: (lambda: Plateau(window=24, warmup=12), Data(normal=1.0 - 0.01 * np.arange(120) + _noise(120), spike=5.0)),
    # recent=1 makes the "recent level" the point itself, so one point can be a collapse.
    Collapse: (lambda: Collapse(recent=1, reference=20), Data(normal=_noise(), spike=0.1)),
    Blowup: (lambda: Blowup(window=32, warmup=16), Data(normal=np.exp(_rng.normal(-4.0, 0.3, 200)), spike=5.0)),
    Explode: (lambda: Explode(), Data(normal=np.exp(_rng.normal(0.0, 0.3, 200)), spike=1e4)),
    CrossRank: (lambda: CrossRank(warmup=8), Data(normal=_rng.normal(1.0, 0.01, (60, 8)), spike=5.0, rank=3)),
    Stall: (lambda: Stall(), Data(normal=np.abs(_rng.normal(1.0, 0.05, 200)), spike=30.0)),
    Ensemble: (
        lambda: Ensemble(members=["nonfinite", ["spike", {"window": 32, "warmup": 16}], ["cusum", {"warmup": 16}]]),
        Data(normal=_noise(), spike=5.0),
    ),
}

CLASSES = [
    obj
    for obj in (getattr(detectors, name) for name in detectors.__all__)
    if isinstance(obj, type) and issubclass(obj, detectors.Detector) and not inspect.isabstract(obj)
]

#: Every (class, check) pair except those the class declares inapplicable, with its reason.
PAIRS = [(cls, check) for cls in CLASSES for check in CHECKS if check.__name__.removeprefix("check_") not in cls.skip_checks]


def test_every_concrete_detector_has_a_conformance_case():
    assert CLASSES, "no concrete detector exported"
    assert set(CLASSES) <= set(CASES), f"add a CASES entry for {set(CLASSES) - set(CASES)}"
    assert detectors.Detector not in CLASSES


def test_declared_check_skips_name_real_checks_and_give_reasons():
    names = {check.__name__.removeprefix("check_") for check in CHECKS}
    for cls in CLASSES:
        for check, reason in cls.skip_checks.items():
            assert check in names, f"{cls.__name__} skips unknown check {check!r}"
            assert len(reason.split()) >= 4, f"{cls.__name__} skips {check!r} without a reason"


@pytest.mark.parametrize(
    "cls, check",
    PAIRS,
    ids=[f"{cls.__name__}:{check.__name__.removeprefix('check_')}" for cls, check in PAIRS],
)
def test_conformance(cls, check):
    factory, data = CASES[cls]
    assert type(factory()) is cls
    check(factory, data)


def test_registry_names_every_detector_and_build_validates():
    assert set(detectors.BY_NAME.values()) == set(CLASSES)
    assert all(name == cls.name for name, cls in detectors.BY_NAME.items())
    assert isinstance(detectors.build("cusum", h=12.0), Cusum)
    with pytest.raises(ValueError, match="choose from"):
        detectors.build("nope")
    with pytest.raises(ValueError, match="cusum"):
        detectors.build("cusum", nonsense=1)


# --- NonFinite ---------------------------------------------------------------------------------


def test_nonfinite_scores_exactly_the_nonfinite_points():
    x = np.array([0.0, -1e308, np.nan, 1e308, np.inf, 5.0, -np.inf])
    np.testing.assert_array_equal(NonFinite().update(x), [0, 0, 1, 0, 1, 0, 1])
    assert NonFinite().decide(np.array([1.0, 0.0])).tolist() == [True, False]
    assert NonFinite.severity == "critical"


# --- RobustSpike -------------------------------------------------------------------------------


def test_spike_fires_on_a_spike_in_noisy_data():
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 0.1, 500)
    x[300] = 4.0  # 20 sigma
    d = RobustSpike()
    flagged = np.flatnonzero(d.decide(d.update(x)))
    assert flagged.tolist() == [300]


def test_spike_fires_on_a_downward_spike_too():
    rng = np.random.default_rng(2)
    x = rng.normal(2.0, 0.1, 300)
    x[250] = 0.0
    d = RobustSpike()
    assert np.flatnonzero(d.decide(d.update(x))).tolist() == [250]


def test_spike_silent_on_pure_gaussian_noise():
    x = np.random.default_rng(3).normal(0.0, 1.0, 10_000)
    d = RobustSpike()
    scores = d.update(x)
    assert not d.decide(scores).any(), f"false alarms at {np.flatnonzero(d.decide(scores))}"
    assert scores.max() < d.threshold


def test_spike_silent_on_a_smoothly_decaying_loss_curve():
    t = np.arange(5_000)
    x = 2.0 * np.exp(-t / 300) + np.random.default_rng(4).normal(0.0, 0.01, len(t))
    d = RobustSpike()
    scores = d.update(x)
    assert not d.decide(scores).any(), f"false alarms at {np.flatnonzero(d.decide(scores))}"


def test_spike_on_decaying_curve_still_fires():
    t = np.arange(2_000)
    x = 2.0 * np.exp(-t / 300) + np.random.default_rng(5).normal(0.0, 0.01, len(t))
    x[1500] += 1.0
    d = RobustSpike()
    assert np.flatnonzero(d.decide(d.update(x))).tolist() == [1500]


def test_spike_nonfinite_points_score_zero_and_are_not_learned():
    d = RobustSpike(window=8, warmup=4)
    d.learn(np.array([1.0, 2.0, 3.0, 4.0]))
    scores = d.update(np.array([np.nan, np.inf, -np.inf]))
    np.testing.assert_array_equal(scores, [0.0, 0.0, 0.0])
    assert d.state_dict()["history"] == [1.0, 2.0, 3.0, 4.0]


def test_spike_history_keeps_only_the_last_window_points():
    d = RobustSpike(window=5, warmup=2, max_period=0)
    d.learn(np.arange(12, dtype=float))
    assert d.state_dict()["history"] == [7.0, 8.0, 9.0, 10.0, 11.0]
    d = RobustSpike(window=5, warmup=2, max_period=3)  # and three periods of the longest period looked for
    d.learn(np.arange(30, dtype=float))
    assert d.state_dict()["history"] == np.arange(16, 30, dtype=float).tolist()
    assert RobustSpike(window=3, warmup=2, max_period=0, history=[1, 2, 3, 4]).state_dict()["history"] == [2.0, 3.0, 4.0]


def test_spike_flat_series_first_wiggle_is_bounded_by_min_scale():
    d = RobustSpike(window=16, warmup=8)
    d.learn(np.ones(16))
    # A tiny wiggle relative to min_scale * |median| = 1e-6 is not a spike; a big jump is.
    assert d.score(np.array([1.0 + 1e-9]))[0] < d.threshold
    assert d.score(np.array([2.0]))[0] >= d.threshold


def test_spike_huge_finite_value_scores_as_a_spike():
    # A finite value so large that (value - median) / scale overflows to inf is the clearest spike
    # of all; it must not score 0.
    d = RobustSpike(window=32, warmup=16)
    d.learn(np.random.default_rng(6).normal(1.0, 0.01, 32))
    with np.errstate(over="ignore"):
        scores = d.score(np.array([5.0, 1e307, -1e307]))
    assert scores[0] >= d.threshold
    assert scores[1] >= d.threshold, "a finite value of 1e307 scored as normal"
    assert scores[2] >= d.threshold


def test_spike_with_min_scale_zero_still_fires_on_a_flat_series_jump():
    # min_scale=0 is accepted by the constructor; a perfectly flat history then has scale 0, and a
    # jump off it is infinitely anomalous, so it must score 1, not 0.
    d = RobustSpike(window=8, warmup=4, min_scale=0.0)
    d.learn(np.full(8, 3.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = d.score(np.array([3.0, 10.0]))
    assert scores[0] == 0.0
    assert scores[1] >= d.threshold, "a jump off a flat series scored as normal"


def test_spike_repr_shows_parameters_not_history():
    r = repr(RobustSpike(window=10, warmup=5, history=[1.0, 2.0]))
    assert r.startswith("RobustSpike(") and "window=10" in r and "warmup=5" in r
    assert "history" not in r


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 2, "warmup": 2},
        {"window": 10, "warmup": 1},
        {"window": 10, "warmup": 11},
        {"threshold": 0.0},
        {"threshold": 1.0},
        {"threshold": 1.5},
        {"memory": 5},
        {"rebase": -1},
        {"min_scale": -1e-9},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_spike_constructor_validation(kwargs):
    with pytest.raises(ValueError):
        RobustSpike(**kwargs)


def test_spike_constructor_is_keyword_only_and_accepts_the_boundaries():
    with pytest.raises(TypeError):
        RobustSpike(64)  # type: ignore[misc]
    d = RobustSpike(window=3, warmup=3, min_scale=0.0)
    assert (d.window, d.warmup, d.min_scale) == (3, 3, 0.0)
    RobustSpike(window=3, warmup=2)


def test_spike_direction_up_ignores_downward_spikes_and_tail_tolerates_routine_bursts():
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 0.01, 400)
    x[300], x[350] = 0.5, 1.5
    d = RobustSpike(direction="up")
    assert np.flatnonzero(d.decide(d.update(x))).tolist() == [350]
    # A busy host: 10% of steps take 5x as long. The calibration learns that such bursts are routine
    # within a few dozen of them; a 50x step is still a spike.
    t = np.where(rng.random(3000) < 0.1, 5.0, 1.0) * rng.lognormal(0.0, 0.05, 3000)
    t[2500] = 50.0
    d = RobustSpike(direction="up")
    scores = d.update(t)
    flags = np.flatnonzero(scores >= d.threshold).tolist()
    assert len(flags) <= 10 and max(flags) < 300  # bursts are learned within the first few dozen
    # On a host this bursty a 50x step is about one in 100,000 (not quite the default one in a million).
    assert scores[2500] >= 0.99999 and scores[2500] == scores[300:].max()
