"""Stage 2's cross-rank and stall detection, on the pure RunWatcher with an injected clock."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rankwatch.contract import RankProgress, Series
from rankwatch.stream_processors.rules import default_rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher


def _progress(rank: int, step: int, world: int, *, ts: float | None = None, **metrics: float) -> RankProgress:
    """A rank's progress, stamped by the rank at ``ts`` (default: one step a second, step = time)."""
    series = {m: Series(np.array([step]), np.array([v])) for m, v in metrics.items()}
    return RankProgress(run="r", rank=rank, world_size=world, last_step=step, ts=float(step) if ts is None else ts,
                        series=series)


def test_a_straggler_among_eight_ranks_is_named_within_a_few_steps():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    rng = np.random.default_rng(0)
    fired = []
    for step in range(80):
        for rank in range(8):
            t = 1.0 + 0.01 * rng.standard_normal() + (0.5 if rank == 5 and step >= 50 else 0.0)
            fired += watcher.observe(watch, _progress(rank, step, 8, compute_time_s=t), now=float(step))
    firing = [(a.rank, a.step) for a in fired if a.status == "firing"]
    assert [r for r, _ in firing] == [5]
    assert 50 <= firing[0][1] <= 53  # the default rule accumulates evidence over a few steps
    assert fired[0].detector == "crossrank" and fired[0].metric == "compute_time_s"


def test_a_row_with_a_silent_rank_is_scored_after_the_wait():
    watcher, watch = RunWatcher(rules=default_rules(), row_wait_s=5.0), RunWatch(run="r")
    for step in range(30):
        for rank in range(4):
            watcher.observe(watch, _progress(rank, step, 4, compute_time_s=1.0), now=float(step))
    for rank in range(3):  # rank 3 never reports step 30
        watcher.observe(watch, _progress(rank, 30, 4, compute_time_s=9.0 if rank == 1 else 1.0), now=30.0)
    assert 30 in watch.tracks["compute_time_s"].rows
    watcher.tick(watch, now=34.0)
    assert 30 in watch.tracks["compute_time_s"].rows
    watcher.tick(watch, now=35.5)
    assert 30 not in watch.tracks["compute_time_s"].rows


def test_a_rank_that_stops_stepping_is_a_stall_and_a_closed_one_is_not():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    for step in range(30):
        for rank in range(4):
            watcher.observe(watch, _progress(rank, step, 4), now=float(step))
    # From step 30 on rank 2 is stuck (its heartbeats repeat step 29), rank 3 closed its publisher.
    closing = RankProgress(run="r", rank=3, world_size=4, last_step=29, ts=0.0, series={}, final=True)
    watcher.observe(watch, closing, now=30.0)
    alerts = []
    for t in range(30, 80):
        for rank in (0, 1):
            watcher.observe(watch, _progress(rank, t, 4), now=float(t))
        watcher.observe(watch, _progress(2, 29, 4, ts=float(t)), now=float(t))  # heartbeats, no new step
        alerts += watcher.tick(watch, now=float(t) + 0.5)
    stalls = [(a.rank, a.status) for a in alerts]
    assert stalls == [(2, "firing")], alerts
    assert alerts[0].detector == "stall" and alerts[0].severity == "critical"


def test_a_heartbeat_after_the_final_batch_does_not_bring_a_finished_rank_back():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    for step in range(30):
        for rank in range(2):
            watcher.observe(watch, _progress(rank, step, 2), now=float(step))
    for rank in range(2):
        final = RankProgress(run="r", rank=rank, world_size=2, last_step=31, ts=0.0, series={}, final=True)
        watcher.observe(watch, final, now=31.0)
    watcher.observe(watch, _progress(1, 31, 2, ts=31.5), now=31.5)  # a late heartbeat at the same step
    assert watcher.tick(watch, now=90.0) == []


def _resumed_job(world: int, *, resumed_world: int | None = None, flag: bool = True,
                 compute=lambda rank, step, resumed: 1.0, stops=lambda rank, step: False) -> tuple[list, RunWatch]:
    """A job that steps once a second to step 99, restarts (5 s) and resumes from the checkpoint of
    step 50 to 129 on ``resumed_world`` ranks; ``flag``: stage 1 marks each rank's first progress
    after the restart. ``stops(rank, step)``: a rank of the first run silent from there on."""
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    alerts, t = [], 0.0
    for steps, n in ((range(100), world), (range(50, 130), resumed_world or world)):
        resumed = steps.start > 0
        t += 5.0
        for step in steps:
            t += 1.0
            for rank in range(n):
                if not resumed and stops(rank, step):
                    continue
                p = _progress(rank, step, n, ts=t, compute_time_s=compute(rank, step, resumed))
                alerts += watcher.observe(watch, dataclasses.replace(p, restarted=flag and resumed and step == 50), now=t)
            alerts += watcher.tick(watch, now=t + 0.5)
    return alerts, watch


def test_a_job_resumed_from_an_earlier_checkpoint_is_stepping_not_stalled():
    # For 50 steps every rank repeats steps it had reached, each new to its new incarnation.
    assert _resumed_job(4)[0] == []
    # What stage 2 made of it before stage 1 said so: the run stalled until it passed step 99 again.
    assert [(a.detector, a.status, a.step) for a in _resumed_job(4, flag=False)[0]] == [
        ("stall", "firing", 99), ("stall", "resolved", 100)]


def test_a_straggler_in_a_job_resumed_from_an_earlier_checkpoint_is_named_while_it_repeats_steps():
    # The job resumes on a slow node (rank 5).
    def named(flag: bool) -> list:
        rng = np.random.default_rng(0)
        alerts, _ = _resumed_job(8, flag=flag, compute=lambda rank, step, resumed: (
            1.0 + 0.01 * rng.standard_normal() + (0.5 if resumed and rank == 5 else 0.0)))
        return [(a.rank, a.step) for a in alerts if a.status == "firing" and a.detector == "crossrank"]

    [(rank, step)] = named(flag=True)
    assert rank == 5 and 50 <= step <= 53
    # Before, the rows of steps 50-99 had been scored: rank 5 was named only past its old last step.
    assert [r for r, s in named(flag=False) if s < 100] == []


def test_an_elastic_job_restarted_with_fewer_ranks_is_no_stall_of_the_ranks_it_left():
    # Rank 3 dies after step 79 (its node failed); the job goes on until it notices, then resumes on
    # the three nodes left.
    alerts, watch = _resumed_job(4, resumed_world=3, stops=lambda rank, step: rank == 3 and step >= 80)
    assert [(a.detector, a.status, a.rank) for a in alerts] == [("stall", "firing", 3), ("stall", "resolved", 3)]
    assert alerts[1].message == "steps on rank 3: the run restarted with 3 ranks; resolved at step 50"
    assert watch.world_size == 3 and 3 not in watch.last_step


def _stopped_job(beat) -> list:
    """Four ranks step once a second, then all stop after step 29; ``beat(rank, t)`` is a rank's
    heartbeat during the stop (its collective wait), or None for a rank that went silent."""
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    for step in range(30):
        for rank in range(4):
            watcher.observe(watch, _progress(rank, step, 4, collective_wait_s=0.0), now=float(step))
    alerts = []
    for t in np.arange(30.0, 60.0, 0.5):
        for rank in range(4):
            wait = beat(rank, t)
            if wait is not None:
                watcher.observe(watch, _progress(rank, 29, 4, ts=t, collective_wait_s=wait), now=t)
        alerts += watcher.tick(watch, now=t + 0.25)
    return alerts


def test_a_ddp_stall_names_the_rank_its_peers_wait_for():
    # Rank 2 hangs outside any collective; the others sit in the all-reduce waiting for it.
    alerts = _stopped_job(lambda rank, t: 0.0 if rank == 2 else t - 29.5)
    assert [(a.rank, a.status) for a in alerts] == [(2, "firing")], alerts
    assert "ranks 0, 1, 3 blocked in a collective" in alerts[0].message


@pytest.mark.parametrize("peers_blocked", [True, False])  # NCCL peers hang in the collective; gloo's raise
def test_a_ddp_stall_names_a_rank_that_died(peers_blocked):
    alerts = _stopped_job(lambda rank, t: None if rank == 1 else (t - 29.5) * peers_blocked)
    assert [(a.rank, a.status, a.step) for a in alerts] == [(1, "firing", 29)], alerts
    assert "heartbeats stopped" in alerts[0].message


def test_a_stall_with_nobody_waiting_is_about_the_whole_run():
    alerts = _stopped_job(lambda rank, t: 0.0)  # e.g. every rank stuck reading data
    assert [(a.rank, a.status) for a in alerts] == [(None, "firing")], alerts


def test_a_straggler_alert_says_when_the_rank_waited_for_a_cpu():
    # Rank 1's host starves it from step 40: its peers wait for it in the all-reduce (the wait rule
    # names it), and the hook measured its wait for a CPU. The same slowdown without one gets no note.
    def run(cpu_wait_s: float) -> str:
        watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
        fired = []
        for step in range(60):
            for rank in range(4):
                slow = step >= 40 and rank == 1
                metrics = {"collective_time_s": 0.002 if slow else 0.010 + 0.020 * (step >= 40) + 0.0005 * rank,
                           "cpu_wait_s": cpu_wait_s if slow else 0.0}
                fired += watcher.observe(watch, _progress(rank, step, 4, **metrics), now=float(step))
        [alert] = [a for a in fired if a.status == "firing"]
        assert (alert.rank, alert.metric) == (1, "collective_time_s")
        return alert.message

    assert run(0.025).endswith("; rank 1 waited 25 ms for a CPU at this step (cpu_wait_s): "
                               "its host may be short of CPU")
    assert "CPU" not in run(0.0)
