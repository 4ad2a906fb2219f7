"""The detectors stage 2 runs over a whole run: ``crossrank`` (ranks against their peers at one step)
and ``stall`` (ranks, or the run, that stop). The conformance checks are in test_detectors.py."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.stream_processors.detectors import CrossRank, Stall

# --- CrossRank -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3, 8, 1024])
def test_crossrank_names_the_straggler(ranks):
    rng = np.random.default_rng(51)
    times = rng.normal(1.0, 0.01, (60, ranks))
    straggler = ranks // 2
    times[40:, straggler] += 0.3
    d = CrossRank(direction="up")
    flagged = np.argwhere(d.decide(d.update(times)))
    assert len(flagged) and set(flagged[:, 1].tolist()) == {straggler}
    assert flagged[0, 0] == 40


def test_crossrank_with_two_ranks_blames_the_one_that_changed():
    rng = np.random.default_rng(52)
    loss = rng.normal(2.0, 0.01, (50, 2))
    loss[30:, 0] -= 0.5  # rank 0 diverges downwards; rank 1 carries on as before
    d = CrossRank()
    flagged = np.argwhere(d.decide(d.update(loss)))
    assert set(flagged[:, 1].tolist()) == {0} and flagged[0, 0] == 30


@pytest.mark.parametrize("ranks, steps", [(2, 3_000), (8, 3_000), (1024, 100)])
def test_crossrank_quiet_on_iid_ranks(ranks, steps):
    x = np.random.default_rng(53).normal(1.0, 0.05, (steps, ranks))
    d = CrossRank()
    assert not d.decide(d.update(x)).any()


def test_crossrank_missing_ranks_direction_and_a_new_world_size():
    rng = np.random.default_rng(54)
    d = CrossRank(direction="up")
    d.update(rng.normal(1.0, 0.01, (20, 8)))
    scores = d.score(np.array([np.nan, 1.0, 1.01, 0.99, 1.0, 1.0, 0.2, 1.8]))
    assert scores[0] == 0.0 and scores[6] == 0.0  # missing, and fast (not a straggler)
    assert d.decide(scores).tolist() == [False] * 7 + [True]
    d.update(rng.normal(1.0, 0.01, (20, 6)))  # restarted with 6 ranks: per-rank history starts over
    assert len(d.state_dict()["rank_mean"]) == 6
    with pytest.raises(ValueError):
        d.score(np.ones((2, 2, 2)))


@pytest.mark.parametrize("ranks", [4, 64])
def test_crossrank_cusum_catches_a_modest_straggler_in_a_few_steps_where_one_step_cannot(ranks):
    rng = np.random.default_rng(55)
    times = rng.normal(1.0, 0.01, (80, ranks))
    times[50:70, 1] += 0.05  # 5 sigma: no single step passes |z| > 7.7, a few in a row add up
    plain = CrossRank(direction="up")
    assert not plain.decide(plain.update(times)).any()
    d = CrossRank(direction="up", cusum_k=2.0, cusum_h=10.0)
    flagged = d.decide(d.update(times))
    first = np.argwhere(flagged)
    assert set(first[:, 1].tolist()) == {1} and 50 < first[0, 0] <= 60
    assert not flagged[78:].any()  # back under the bound about cusum_h / cusum_k steps after recovering


def test_crossrank_cusum_ignores_one_hiccup_however_large_and_is_quiet_on_noise():
    x = np.random.default_rng(56).normal(1.0, 0.05, (3_000, 8))
    x[1_500, 2] = 50.0
    d = CrossRank(direction="up", cusum_k=2.0, cusum_h=10.0)
    assert not d.decide(d.update(x)).any()
    again = CrossRank(**d.state_dict())
    row = np.full(8, 1.0)
    assert np.array_equal(again.score(row), d.score(row)) and np.array_equal(again.rank_sum, d.rank_sum)


def test_crossrank_persist_ignores_random_one_step_slowdowns_and_still_names_a_straggler():
    # Four ranks on two cores: each step one rank at random is descheduled and runs 1.5x slow, as
    # slow as the straggler (issue 18: most false straggler alerts on a loaded host). The straggler
    # differs only in staying slow.
    rng = np.random.default_rng(57)
    times = rng.normal(1.0, 0.02, (300, 4))
    last = -1
    for step in range(300):
        if rng.random() < 0.3:
            last = int(rng.choice([r for r in range(4) if r != last]))  # never the same rank twice running
            times[step, last] *= 1.5
        else:
            last = -1
    times[200:260, 2] *= 1.5
    plain = CrossRank(direction="up", min_rel=0.02)
    assert plain.decide(plain.update(times))[:200].any()  # each slowdown is far past |z| = 7.7
    d = CrossRank(direction="up", min_rel=0.02, persist=2)
    flagged = d.decide(d.update(times))
    named = np.argwhere(flagged)
    assert set(named[:, 1].tolist()) == {2} and named[0, 0] == 201  # its second slow step
    # With the CUSUM of the proposed rules, a step or two later.
    d = CrossRank(direction="up", min_rel=0.02, persist=2, cusum_k=2.0, cusum_h=6.0)
    named = np.argwhere(d.decide(d.update(times)))
    assert set(named[:, 1].tolist()) == {2} and 201 <= named[0, 0] <= 203
    again = CrossRank(**d.state_dict())
    row = np.full(4, 1.0)
    assert np.array_equal(again.score(row), d.score(row)) and np.array_equal(again.rank_recent, d.rank_recent)


def test_crossrank_persist_with_both_directions_needs_the_steps_on_one_side():
    # A rank's minibatch loss far below its peers' at one step and far above at the next (seen on a
    # clean 4-rank run at steps 27-28, issue 18) is noise; a rank that stays off on one side diverges.
    rng = np.random.default_rng(58)
    loss = rng.normal(2.0, 0.02, (120, 4))
    loss[60, 0] -= 0.3
    loss[61, 0] += 0.3
    loss[100:, 3] += 0.3
    d = CrossRank(persist=2)
    named = np.argwhere(d.decide(d.update(loss)))
    assert set(named[:, 1].tolist()) == {3} and named[0, 0] == 101
    plain = CrossRank()  # without persistence both flips are flagged
    assert plain.decide(plain.update(loss))[60:62, 0].all()


# --- Stall ---------------------------------------------------------------------------------------


def _beat(d: Stall, ranks, start: float, steps: int, every: float = 1.0) -> float:
    for k in range(steps):
        for r in ranks:
            d.observe(r, start + k * every)
    return start + (steps - 1) * every


def test_stall_learned_bound_names_the_silent_rank_then_the_whole_run():
    d = Stall(min_bound_s=0.0)
    last = _beat(d, range(8), 0.0, 30)
    assert d.check(now=last + 5.0) == []
    last = _beat(d, [r for r in range(8) if r != 6], last + 1.0, 15)
    stalled = d.check(now=last + 1.0)
    assert [s.rank for s in stalled] == [6] and stalled[0].silent_s == pytest.approx(16.0)
    assert stalled[0].bound_s == pytest.approx(10.0) and stalled[0].score > d.threshold
    (run,) = d.check(now=last + 30.0)
    assert run.rank is None and run.silent_s == pytest.approx(30.0)
    d.forget(6)
    assert d.check(now=last + 1.0) == []


def test_stall_does_not_learn_a_ranks_slow_start_as_its_pace():
    d = Stall(min_bound_s=0.0)
    for r in range(4):
        d.observe(r, -120.0 - r)  # a heartbeat while the model loads, two minutes before step 1
    _beat(d, range(4), 0.0, 30)
    assert d.bound() == pytest.approx(10.0)  # 10 x the one-second pace, not 2 x the start-up
    assert Stall(**d.state_dict()).paced == d.paced == {0, 1, 2, 3}


def test_stall_ranks_that_stop_together_are_one_run_stall_even_if_they_arrive_apart():
    d = Stall(min_bound_s=0.0)
    last = _beat(d, range(4), 0.0, 30)
    d.observe(1, last + 1.0)
    d.observe(2, last + 1.2)  # the last steps before a DDP hang reach the worker up to 2 s apart
    d.observe(3, last + 2.9)
    assert d.check(now=last + 11.0) == []  # rank 0 past its bound, but its peers stopped with it
    (run,) = d.check(now=last + 13.0)
    assert run.rank is None and run.silent_s == pytest.approx(10.1)
    for r in (2, 0, 3):
        d.observe(r, last + 30.0)  # the run resumes; rank 1's first step arrives last
    assert d.check(now=last + 31.0) == []
    end = _beat(d, [0, 2, 3], last + 31.0, 80)
    assert d.bound() < 60.0
    stalled = d.check(now=end + 1.0)  # silent for a bound since the others resumed: stalled alone
    assert [s.rank for s in stalled] == [1] and stalled[0].silent_s == pytest.approx(end + 1.0 - last - 30.0)


def test_stall_fixed_bound_needs_no_warmup_and_ignores_out_of_order_stamps():
    d = Stall(bound_s=60.0)
    d.observe(0, 100.0)
    d.observe(1, 100.0)
    d.observe(1, 50.0)  # late duplicate: ignored
    assert d.check(now=150.0) == []
    d.observe(0, 130.0)
    d.observe(0, 170.0)
    assert [s.rank for s in d.check(now=171.0)] == [1]


def test_stall_a_pause_all_ranks_took_is_routine_but_one_ranks_stall_teaches_nothing():
    d = Stall(min_bound_s=0.0)
    last = _beat(d, [0, 1, 2], 0.0, 30)
    d.observe(0, last + 1e4)  # rank 0 hung for hours and came back: that is no new normal
    assert d.bound() == pytest.approx(10.0)
    d.observe(1, last + 25.0)  # then every other rank paused 25 s (an evaluation): routine from now on
    d.observe(2, last + 25.0)
    assert d.bound() == pytest.approx(50.0, rel=0.01)


def test_stall_state_round_trips_with_its_ranks():
    import json

    d = Stall()
    _beat(d, range(3), 0.0, 20)
    back = Stall.from_state(json.loads(json.dumps(d.state_dict())))
    assert back.check(now=60.0) == d.check(now=60.0) and back.check(now=60.0)


# --- stragglers stay named while they are slow (issue 18) -----------------------------------------


def _rule_detector(metric: str):
    from rankwatch.stream_processors.rules import default_rules

    return default_rules().cross_rank_rule(metric).build()


def test_a_two_rank_straggler_stays_firing_while_it_is_slower_than_its_peer():
    # Plain DDP, rank 1 slowed by 200 ms per step from step 80 (compute 239 ms against 37 ms).
    rng = np.random.default_rng(18)
    compute = rng.normal(0.037, 0.003, (200, 2))
    compute[80:170, 1] += 0.2
    d = _rule_detector("compute_time_s")
    flagged = d.decide(d.update(compute))
    assert flagged[80:83, 1].any()  # named within 3 steps
    assert flagged[83:170, 1].all()  # and for as long as it is slow
    assert not flagged[:, 0].any() and not flagged[:78, 1].any()
    assert not flagged[185:, 1].any()  # back to normal once it recovers


def test_a_slowdown_that_shows_as_the_peers_collective_wait_is_named():
    # A 50 ms slowdown (85 -> 110 ms) on rank 1: rank 0's wait in the all-reduce rises 10 -> 57 ms.
    rng = np.random.default_rng(19)
    wait = np.abs(rng.normal(0.010, 0.002, (200, 2)))
    wait[80:, 0] = rng.normal(0.057, 0.004, 120)
    d = _rule_detector("collective_time_s")
    flagged = d.decide(d.update(wait))
    assert flagged[80:83, 1].any() and flagged[83:, 1].all()
    assert not flagged[:, 0].any() and not flagged[:80].any()
