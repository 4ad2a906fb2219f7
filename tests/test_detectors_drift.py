"""Detectors that follow a level, a shift or a trend: EWMA residual, CUSUM and Page-Hinkley, trend and
plateau, collapse and blow-up, the ensemble and explode (the registry, conformance and spikes are in
``test_detectors.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.stream_processors.detectors import (
    Blowup,
    Collapse,
    Cusum,
    Ensemble,
    EwmaResidual,
    Explode,
    NonFinite,
    PageHinkley,
    Plateau,
    RobustSpike,
    Trend,
)


# --- shared noise generators --------------------------------------------------------------------


def _ar1(n: int, rho: float, seed: int) -> np.ndarray:
    from scipy.signal import lfilter

    return lfilter([1.0], [1.0, -rho], np.random.default_rng(seed).normal(0.0, 1.0, n))


def _flags(detector, x) -> list[int]:
    return np.flatnonzero(detector.decide(detector.update(np.asarray(x, dtype=float)))).tolist()


# --- EwmaResidual --------------------------------------------------------------------------------


def test_ewma_fires_on_a_spike_and_is_silent_on_noise_and_a_decaying_curve():
    rng = np.random.default_rng(11)
    x = rng.normal(5.0, 0.2, 600)
    x[400] = 8.0
    assert _flags(EwmaResidual(), x) == [400]
    assert _flags(EwmaResidual(), rng.normal(0.0, 1.0, 10_000)) == []
    t = np.arange(5_000)
    assert _flags(EwmaResidual(), 2.0 * np.exp(-t / 300) + rng.normal(0.0, 0.01, len(t))) == []


def test_ewma_follows_a_level_change_and_one_outlier_barely_moves_it():
    x = np.r_[np.random.default_rng(12).normal(0.0, 1.0, 300), np.random.default_rng(13).normal(30.0, 1.0, 300)]
    flags = _flags(EwmaResidual(), x)
    assert flags[0] == 300 and max(flags) < 400  # it learns the new level instead of alarming forever
    d = EwmaResidual()
    d.update(np.random.default_rng(14).normal(0.0, 1.0, 100))
    before = d.mean
    d.update(np.array([1e6]))
    assert abs(d.mean - before) < 0.5  # Huber clipping: one wild point moves the level ~alpha*clip sigma


def test_ewma_direction_and_nonfinite_points():
    x = np.r_[np.random.default_rng(15).normal(0.0, 1.0, 100), -20.0, 20.0]
    assert _flags(EwmaResidual(direction="up"), x) == [101]
    assert _flags(EwmaResidual(direction="down"), x) == [100]
    d = EwmaResidual()
    d.update(np.ones(30))
    state = d.state_dict()
    assert d.update(np.array([np.nan, np.inf])).tolist() == [0.0, 0.0]
    assert d.state_dict() == state


# --- Cusum and PageHinkley -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Cusum, PageHinkley])
def test_shift_detectors_report_a_level_shift_once(cls):
    rng = np.random.default_rng(21)
    x = np.r_[rng.normal(0.0, 1.0, 300), rng.normal(3.0, 1.0, 500)]
    flags = _flags(cls(), x)
    assert len(flags) == 1 and 300 <= flags[0] <= 312, flags


@pytest.mark.parametrize("cls", [Cusum, PageHinkley])
def test_shift_detectors_ignore_one_outlier_and_the_other_direction(cls):
    rng = np.random.default_rng(22)
    x = rng.normal(0.0, 1.0, 400)
    x[200] = 1e3
    assert _flags(cls(), x) == []
    y = np.r_[rng.normal(0.0, 1.0, 200), rng.normal(-3.0, 1.0, 200)]
    assert _flags(cls(direction="up"), y) == []
    assert len(_flags(cls(direction="down"), y)) == 1


@pytest.mark.parametrize("cls", [Cusum, PageHinkley])
@pytest.mark.parametrize("noise", ["gaussian", "ar1", "student_t3"])
def test_shift_detectors_silent_on_10k_points_of_noise(cls, noise):
    rng = np.random.default_rng(23)
    x = {
        "gaussian": lambda: rng.normal(0.0, 1.0, 10_000),
        "ar1": lambda: _ar1(10_000, 0.5, 24),  # autocorrelated, like most real metrics
        "student_t3": lambda: rng.standard_t(3, 10_000),
    }[noise]()
    assert len(_flags(cls(), x)) <= 1  # the bench's target: at most one false alert per 10k points


def test_cusum_up_is_silent_on_a_decaying_loss_but_catches_it_turning_up():
    rng = np.random.default_rng(25)
    t = np.arange(3_000)
    loss = 2.0 * np.exp(-t / 500) + 0.5 + rng.normal(0.0, 0.02, len(t))
    assert _flags(Cusum(direction="up"), loss) == []
    loss[2000:] += 0.1  # five sigmas up, and it stays up
    flags = _flags(Cusum(direction="up"), loss)
    assert flags and 2000 <= flags[0] <= 2010


def test_page_hinkley_catches_a_slow_drift():
    rng = np.random.default_rng(26)
    x = np.r_[rng.normal(0.0, 1.0, 300), rng.normal(0.0, 1.0, 300) + 0.02 * np.arange(300)]
    flags = _flags(PageHinkley(direction="up"), x)
    assert flags and 300 < flags[0] < 450


# --- Trend and Plateau ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed, ties", [(0, False), (1, True), (2, False)])
def test_window_trend_matches_scipy(seed, ties):
    from scipy import stats

    from rankwatch.stream_processors.detectors.trend import window_trend

    rng = np.random.default_rng(seed)
    y = 0.05 * np.arange(50) + rng.normal(0.0, 1.0, 50)
    if ties:
        y = np.round(y, 0)
    got = window_trend(y, alpha=0.05)
    tau = stats.kendalltau(np.arange(50), y, method="asymptotic")
    sen = stats.theilslopes(y, alpha=0.95)
    assert got.slope == pytest.approx(sen.slope, abs=1e-12)
    assert (got.low_slope, got.high_slope) == pytest.approx((sen.low_slope, sen.high_slope), abs=1e-12)
    assert 2 * stats.norm.sf(abs(got.z)) == pytest.approx(tau.pvalue, rel=1e-9)


def test_trend_fires_on_a_ramp_in_its_direction_only():
    rng = np.random.default_rng(31)
    ramp = np.r_[rng.normal(0.0, 1.0, 200), rng.normal(0.0, 1.0, 100) + 0.1 * np.arange(100)]
    flags = _flags(Trend(direction="up"), ramp)
    assert flags and 200 < flags[0] < 260
    assert _flags(Trend(direction="down"), ramp) == []
    assert _flags(Trend(direction="both"), -ramp)


def test_trend_silent_on_noise_and_on_a_decaying_loss_watched_for_rises():
    rng = np.random.default_rng(32)
    assert _flags(Trend(direction="both"), rng.normal(0.0, 1.0, 10_000)) == []
    t = np.arange(3_000)
    assert _flags(Trend(direction="up"), 2.0 * np.exp(-t / 400) + rng.normal(0.0, 0.05, len(t))) == []


def test_plateau_fires_when_progress_stops_and_not_while_it_continues():
    rng = np.random.default_rng(33)
    t = np.arange(600)
    improving = 3.0 - 0.002 * t + rng.normal(0.0, 0.02, len(t))
    assert _flags(Plateau(window=100, warmup=80), improving) == []
    stalled = np.where(t < 300, improving, improving[300] + rng.normal(0.0, 0.02, len(t)))
    flags = _flags(Plateau(window=100, warmup=80), stalled)
    assert flags and 300 < flags[0] < 400
    accuracy = 1.0 - stalled  # improving upwards, then stuck
    assert _flags(Plateau(window=100, warmup=80, improving="up"), accuracy)[0] > 300


# --- Collapse and Blowup -------------------------------------------------------------------------


def test_collapse_fires_on_a_reward_collapse_and_not_on_noise_a_bad_episode_or_a_slow_decline():
    rng = np.random.default_rng(41)
    reward = np.r_[rng.normal(0.9, 0.05, 300), rng.normal(0.4, 0.05, 100)]
    flags = _flags(Collapse(), reward)
    assert flags and 300 <= flags[0] <= 310
    assert _flags(Collapse(), rng.normal(0.9, 0.05, 10_000)) == []
    one_bad = rng.normal(0.9, 0.05, 400)
    one_bad[250:253] = 0.0
    assert _flags(Collapse(), one_bad) == []
    assert _flags(Collapse(), np.linspace(1.0, 0.5, 2_000) + rng.normal(0.0, 0.01, 2_000)) == []


def test_collapse_of_entropy_and_the_upward_direction():
    rng = np.random.default_rng(42)
    entropy = np.r_[rng.normal(1.2, 0.05, 200), rng.normal(0.1, 0.02, 50)]
    assert _flags(Collapse(), entropy)[0] >= 200
    assert _flags(Collapse(direction="up"), entropy) == []
    assert _flags(Collapse(direction="up"), -entropy + 3.0)[0] >= 200


def test_blowup_fires_on_a_kl_blowup_only_upwards_and_respects_min_factor():
    rng = np.random.default_rng(43)
    kl = np.exp(rng.normal(np.log(1e-3), 0.5, 600))
    kl[400], kl[450], kl[500] = 0.5, 0.0, -1e-4  # a blow-up, then a zero and a negative estimate
    assert _flags(Blowup(), kl) == [400]
    assert _flags(Blowup(), np.exp(rng.normal(0.0, 1.0, 10_000))) == []
    steady = np.full(100, 2.0) + rng.normal(0.0, 1e-4, 100)
    steady[80], steady[90] = 5.0, 7.0  # 2.5x is under min_factor=3, 3.5x is over
    assert _flags(Blowup(), steady) == [90]


# --- Ensemble ------------------------------------------------------------------------------------


def test_ensemble_decides_exactly_when_a_member_does():
    rng = np.random.default_rng(61)
    # An 8-sigma shift: smaller ones are cusum's (not a default member since calibration).
    x = np.r_[rng.normal(0.0, 1.0, 300), rng.normal(8.0, 1.0, 200)]
    x[150], x[400] = 20.0, np.nan
    members = [NonFinite(), RobustSpike(), EwmaResidual()]
    expected = np.any([m.decide(m.update(x)) for m in members], axis=0)
    d = Ensemble()
    scores = d.update(x)
    np.testing.assert_array_equal(d.decide(scores), expected)
    assert {150, 400} <= set(np.flatnonzero(expected).tolist()) and expected[300:312].any()


def test_ensemble_members_are_configurable_and_validated():
    d = Ensemble(members=[["cusum", {"direction": "up"}], "spike"])
    assert [m.name for m in d.members] == ["cusum", "spike"] and d.members[0].direction == "up"
    assert d.warmup == 40  # the longest member's (spike)
    for bad in ([], [["crossrank", {}]], [["spike"]], ["nope"]):
        with pytest.raises(ValueError):
            Ensemble(members=bad)


# --- Explode -------------------------------------------------------------------------------------


def test_explode_catches_a_divergence_at_its_first_step_and_stays_firing():
    # The GPT-2 at lr 30: 7 -> 28,642 at step 2, then about 1e5.
    loss = np.r_[7.0, 6.9, 28642.0, np.full(50, 1e5)]
    flags = _flags(Explode(), loss)
    assert flags == list(range(2, len(loss)))
    assert _flags(Explode(patience=10), loss)[-1] < len(loss) - 1  # with patience, a lasting scale is learned


def test_explode_is_quiet_on_healthy_training_curves_and_sign_changing_losses():
    rng = np.random.default_rng(3)
    t = np.arange(5000)
    loss = (0.3 + 7.0 * np.exp(-t / 300)) * np.exp(rng.normal(0.0, 0.2, 5000))
    grad = np.where(rng.random(5000) < 0.02, 20.0, 1.0) * np.exp(rng.normal(0.0, 0.5, 5000))
    rl_loss = rng.normal(0.0, 0.05, 5000)
    for x in (loss, grad, rl_loss):
        assert _flags(Explode(), x) == []
