"""Evaluation statistics: intervals against known values, consistency and regression tests that
catch what they should and stay quiet on noise, composite score, early stopping, eval interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from rankwatch.stream_processors.evaluation import (
    IntervalAdvisor,
    StopRule,
    compare,
    composite,
    consistency,
    parse_weights,
    summarize,
    wilson_interval,
)
from rankwatch.stream_processors.evaluation.stats import holm


@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (1, 3), (45, 50), (512, 1000), (7, 2000)])
def test_wilson_interval_equals_scipy_binomtest(k, n):
    lo, hi = wilson_interval(k, n)
    ref = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert (float(lo), float(hi)) == pytest.approx((ref.low, ref.high), abs=1e-12)


def test_binary_summary_uses_wilson_and_stays_inside_0_1():
    s = summarize([1.0] * 20)
    assert (s.method, s.n, s.mean, s.ci_high) == ("wilson", 20, 1.0, 1.0)
    assert s.ci_low == pytest.approx(0.8389, abs=1e-4)  # Wilson, where Wald would say [1, 1]


def test_continuous_summary_is_the_t_interval():
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    half = stats.t.ppf(0.975, 4) * math.sqrt(2.5) / math.sqrt(5)
    assert s.method == "t"
    assert (s.n, s.mean, s.std) == (5, 3.0, pytest.approx(math.sqrt(2.5)))
    assert (s.ci_low, s.ci_high) == pytest.approx((3 - half, 3 + half))
    assert (round(s.ci_low, 3), round(s.ci_high, 3)) == (1.037, 4.963)


def test_non_finite_values_are_left_out_and_counted_out():
    s = summarize([1.0, 0.0, math.nan, math.inf, 1.0])
    assert (s.method, s.n, s.mean) == ("wilson", 3, pytest.approx(2 / 3))
    assert summarize([]).n == 0 and math.isnan(summarize([]).mean)


def test_holm_adjustment_matches_the_textbook_example():
    assert holm([0.01, 0.04, 0.03, 0.005]).tolist() == pytest.approx([0.03, 0.06, 0.06, 0.02])


def _fair(rng, ranks=4, n=250, p=0.8):
    return {r: rng.binomial(1, p, n).astype(float) for r in range(ranks)}


@pytest.mark.parametrize("bad_rank", [0, 3])
def test_consistency_names_the_corrupted_rank_and_only_it(bad_rank):
    rng = np.random.default_rng(bad_rank)
    data = _fair(rng)
    data[bad_rank] = rng.binomial(1, 0.6, 250).astype(float)  # e.g. stale weights on that rank
    result = consistency(data)
    assert result.test == "chi2" and result.p_value < 1e-6
    assert result.outliers == [bad_rank] and not result.ambiguous
    assert min(result.rank_p, key=result.rank_p.get) == bad_rank


def test_consistency_names_a_rank_with_shifted_continuous_results():
    rng = np.random.default_rng(5)
    data = {r: rng.gamma(2.0, 50.0, 200) for r in range(8)}
    data[6] = data[6] * 1.6  # a data-skew bug: this rank's answers are longer
    result = consistency(data)
    assert result.test == "kruskal" and result.outliers == [6]


def test_consistency_is_quiet_on_fair_data():
    rng = np.random.default_rng(11)
    runs = 200
    # Loose alpha so the rate is measurable: P(more than 20 of 200 | rate 0.05) < 1e-3.
    flagged = sum(not consistency(_fair(rng), alpha=0.05).consistent for _ in range(runs))
    assert flagged <= 20
    flagged_default = sum(not consistency(_fair(rng)).consistent for _ in range(runs))
    assert flagged_default <= 2  # the default alpha, 0.001
    continuous = sum(not consistency({r: rng.normal(100, 15, 150) for r in range(6)}, alpha=0.05).consistent
                     for _ in range(100))
    assert continuous <= 12


def test_two_disagreeing_ranks_are_reported_without_naming_one():
    rng = np.random.default_rng(2)
    result = consistency({0: rng.binomial(1, 0.9, 300).astype(float), 1: rng.binomial(1, 0.5, 300).astype(float)})
    assert result.ambiguous and result.outliers == []


def test_consistency_needs_two_ranks_with_data_and_handles_constant_values():
    assert consistency({0: np.ones(100), 1: np.ones(3)}) is None
    same = consistency({r: np.ones(50) for r in range(4)})
    assert same.consistent and same.p_value == 1.0
    assert consistency({r: np.full(50, 7.0) for r in range(4)}).consistent


def test_regression_detects_a_drop_in_accuracy_but_not_a_rise():
    old = summarize([1.0] * 850 + [0.0] * 150)
    new = summarize([1.0] * 780 + [0.0] * 220)
    drop = compare(old, new)
    assert drop.test == "z" and drop.p_value < 1e-4 and drop.delta == pytest.approx(-0.07)
    assert compare(new, old).p_value > 0.99


def test_regression_direction_is_configurable_for_continuous_metrics():
    rng = np.random.default_rng(3)
    short, long_ = summarize(rng.normal(100, 20, 400)), summarize(rng.normal(110, 20, 400))
    assert compare(short, long_).p_value > 0.99  # higher is better: longer is no drop
    worse = compare(short, long_, higher_is_better=False)
    assert worse.test == "welch" and worse.p_value < 1e-6


def test_regression_is_quiet_on_noise():
    rng = np.random.default_rng(4)
    hits = sum(compare(summarize(rng.binomial(1, 0.8, 500)), summarize(rng.binomial(1, 0.8, 500))).p_value < 0.05
               for _ in range(300))
    assert hits <= 27  # nominal 15; P(> 27) < 1e-3
    cont = sum(compare(summarize(rng.normal(0, 1, 200)), summarize(rng.normal(0, 1, 200))).p_value < 0.05
               for _ in range(150))
    assert cont <= 17


def test_composite_is_the_weighted_sum_of_means_and_needs_every_weighted_metric():
    assert composite({"correct": 0.5, "reward": 2.0}, {"correct": 2.0, "reward": 0.25}) == pytest.approx(1.5)
    assert composite({"correct": 0.5}, {"correct": 1.0, "reward": 1.0}) is None
    assert composite({"correct": math.nan}, {"correct": 1.0}) is None
    assert composite({"correct": 0.5}, {}) is None


def test_parse_weights_rejects_malformed_text():
    assert parse_weights("") == {}
    for bad in ("correct", "correct=x", "=1"):
        with pytest.raises(ValueError, match="metric=weight"):
            parse_weights(bad)


def test_stop_rule_waits_for_min_samples_even_when_the_ci_is_tight():
    rule = StopRule(target=0.05, min_samples=200)
    assert rule.half_width(np.ones(150)) < 0.05
    assert not rule.should_stop(np.ones(150)) and rule.should_stop(np.ones(200))


def test_stop_rule_uses_the_finite_population_correction():
    values = np.r_[np.ones(450), np.zeros(50)]
    rule = StopRule(target=0.01, min_samples=100)
    assert rule.half_width(values, population=500) == 0.0  # everything seen: no uncertainty left
    assert rule.half_width(values[:400], population=500) < rule.half_width(values[:400]) / 2
    assert not rule.should_stop(values[::2]) and not rule.should_stop(values[::2], population=500)
    assert rule.should_stop(values[:480], population=500)


def test_vectorised_half_widths_equal_the_rule_on_values():
    rule, values = StopRule(), np.r_[np.ones(300), np.zeros(60)]
    k, n = np.array([0, 250, 300]), np.array([1, 300, 360])
    got = rule.binary_half_widths(k, n, population=1000)
    assert got[0] == np.inf
    assert got[1] == pytest.approx(rule.half_width(np.r_[np.ones(250), np.zeros(50)], 1000))
    assert got[2] == pytest.approx(rule.half_width(values, 1000))


def test_stop_rule_keeps_early_accuracy_within_a_point_on_shuffled_data():
    rng = np.random.default_rng(7)
    full = (rng.random(5000) < 0.9).astype(float)
    rule, errors, used = StopRule(target=0.01, min_samples=200), [], []
    for _ in range(50):
        order = rng.permutation(full)
        n = next(n for n in range(200, 5001, 100) if rule.should_stop(order[:n], population=5000))
        errors.append(abs(order[:n].mean() - full.mean()))
        used.append(n)
    assert np.mean(used) < 0.63 * 5000
    assert np.mean(np.array(errors) < 0.01) >= 0.9


def test_interval_advisor_lengthens_while_swinging_and_shortens_when_stable():
    advisor = IntervalAdvisor(min_interval=10, max_interval=1000, window=5)
    steps = [100, 200, 300, 400, 500]
    swinging = advisor.suggest(steps, [0.5, 0.8, 0.4, 0.9, 0.45], [0.01] * 5)
    assert (swinging.current, swinging.interval) == (100, 200) and swinging.swing > 3
    stable = advisor.suggest(steps, [0.80, 0.81, 0.80, 0.79, 0.80], [0.01] * 5)
    assert stable.interval == 50 and stable.swing < 1.5 and stable.drift < 1
    trending = advisor.suggest(steps, [0.50, 0.55, 0.60, 0.65, 0.70], [0.01] * 5)
    assert trending.interval == 100 and trending.drift > 1  # steady progress: keep the pace


def test_interval_advisor_respects_bounds_and_needs_history():
    advisor = IntervalAdvisor(min_interval=80, max_interval=150)
    assert advisor.suggest([100, 200, 300], [0.5, 0.6, 0.7], [0.01] * 3) is None
    steps = [100, 200, 300, 400]
    assert advisor.suggest(steps, [0.5, 0.9, 0.4, 0.9], [0.01] * 4).interval == 150
    assert advisor.suggest(steps, [0.8, 0.8, 0.8, 0.8], [0.01] * 4).interval == 80
    with pytest.raises(ValueError):
        IntervalAdvisor(min_interval=0)
