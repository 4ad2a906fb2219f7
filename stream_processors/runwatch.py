"""Stage 2's own detection: ranks compared with their peers at each step, and ranks that stop.

Both need every rank of a run in one place, which only the run-keyed stage has. Input is the
``RankProgress`` stage 1 sends per applied batch: the values of the metrics a ``crossrank`` rule
watches, and the step reached. Output is per-rank alert transitions (the same ``AlertPolicy`` as
stage 1), which stage 2 then groups like any other.

A step's row is scored once every rank has reported it, or once ``row_wait_s`` has passed (the
missing ranks count as missing, which ``crossrank`` skips).

When every rank stops (a DDP job stops as a whole when one rank hangs or dies), the stall names the
ranks that caused it if the heartbeats tell: ranks that went silent while others still send
heartbeats (dead processes), or else the ranks *not* blocked in a collective while others are
(a rank whose heartbeat reports it blocked for most of the stall is waiting for a peer). Without
such evidence the alert is about the whole run.

The state survives a rebalance and a crash (issue 16): the worker writes a run's watch to a table
(``to_dict``, versioned) whenever a batch changes it, and the worker that gets the run's partition
next reads it back from the changelog (``RunWatch.from_dict``). Replays that at-least-once delivery
brings after a crash change nothing: each cross-rank metric keeps the last step it took from each
rank, and the stall detector ignores stamps it has seen.

Ranks are judged by their own clocks and steps (event time), never by when the worker gets to
their messages, so a worker catching up on a backlog (after a restart, an outage, a burst) raises no
stall and no straggler (issue 16). The run's "now" is its newest batch's timestamp, plus the time
since the run's last message arrived: while messages flow, however late, only the ranks' own
stamps count; once none arrive, silence grows with the wall clock, as a stopped run's should. A
rank is stalled alone only if it is silent both ways: behind its peers' stamps *and* with no new
step arriving for the bound; and where other ranks share its telemetry partition, only once they
have been read a bound past its last step (a rank whose partition the worker reads later than
others' is late, not stalled). Rank clocks are assumed synchronised to well under a stall bound (NTP: milliseconds;
the default bound is at least 10 s).

The worker's side of that is measured on an :class:`~rankwatch.stream_processors.clocks.OutageClock`,
which stops while the worker cannot reach the broker (then no rank can reach it either) and while
it is behind on its own input: then a rank's silence says nothing about the rank.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from rankwatch.contract import COLLECTIVE_WAIT, CPU_WAIT, Alert, RankProgress, Series
from rankwatch.errors import RankwatchError
from rankwatch.stream_processors import restarts, stored
from rankwatch.stream_processors.clocks import OutageClock
from rankwatch.stream_processors.detectors import CrossRank, Stall
from rankwatch.stream_processors.detectors.stall import Stalled
from rankwatch.stream_processors.grouping import ranks_text
from rankwatch.stream_processors.policies import AlertPolicy, Condition, resolve_retired
from rankwatch.stream_processors.rules import Rule, Rules

STALL_METRIC = "steps"  # what a stall alert is about: the rank stopped advancing steps
# A rank waits for a peer if, during a stall, a heartbeat reports it blocked in one collective for at
# least this long and for at least half of its silence so far.
MIN_BLOCKED_S = 1.0
# A rank not heard from (no batch, no heartbeat) for this fraction of the stall bound has stopped
# sending: with the default 5 s heartbeats and a bound of at least 10 s, a live rank never gets there.
SILENT_FRACTION = 0.75
# A straggler alert quotes the rank's wait for a CPU from this much on: on a host with a core per
# rank it stays well below, and on the demo's over-full 2-core VM starved ranks waited 5-30 ms a step.
CPU_NOTED_S = 0.001
#: Version of ``RunWatch.to_dict``; a worker reads only this one (see ``WatchStateError``).
WATCH_VERSION = 2


class WatchStateError(RankwatchError, ValueError):
    """A stored run watch this worker cannot read (a newer or older format): never guess at it."""


@dataclass
class _Track:
    """One cross-rank metric of one run.

    Rows still waiting for ranks are not stored: they hold up to ``row_wait_s`` of steps of every
    rank, which at thousands of ranks is most of the watch, rewritten at every batch. A worker that
    takes the run over scores those steps with the ranks it hears from then on (a rank already
    applied counts as missing, which ``crossrank`` skips); baselines, conditions and cursors carry over.
    """

    rule: Rule
    detector: CrossRank
    rows: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> value
    opened: dict[int, float] = field(default_factory=dict)  # step -> wall time of its first value
    conditions: dict[int, Condition] = field(default_factory=dict)
    applied: dict[int, int] = field(default_factory=dict)  # rank -> last step put in a row (replays skip)
    scored: int = -1  # rows are scored in step order; a value for a step up to this one comes too late

    def to_dict(self) -> dict:
        return {
            "detector": self.detector.state_dict(),
            "conditions": {str(r): c.to_dict() for r, c in self.conditions.items()},
            "applied": {str(r): s for r, s in self.applied.items()},
            "scored": self.scored,
        }

    @classmethod
    def from_dict(cls, d: dict, rule: Rule) -> _Track:
        return cls(
            rule, CrossRank.from_state(d["detector"]) if rule.fits(d["detector"]) else rule.build(),
            conditions={int(r): Condition(**c) for r, c in d["conditions"].items()},
            applied={int(r): int(s) for r, s in d["applied"].items()},
            scored=int(d["scored"]),
        )


@dataclass
class RunWatch:
    run: str
    world_size: int = 0
    partition: int = -1  # of the run-events topic: the worker owning it ticks this watch
    tracks: dict[str, _Track] = field(default_factory=dict)
    stall: Stall | None = None
    stall_conditions: dict[int | None, Condition] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)
    # Event time (the ranks' stamps): rank -> stamp of its last batch; rank -> (collective wait, its stamp)
    heard: dict[int, float] = field(default_factory=dict)
    waits: dict[int, tuple[float, float]] = field(default_factory=dict)
    latest_ts: float = -math.inf  # the newest stamp of any rank of the run
    # On the outage clock: when the run's last message arrived, and each rank's last new step
    arrived: float = -math.inf
    stepped: dict[int, float] = field(default_factory=dict)
    clock: float = -math.inf  # the outage clock's reading at the last change
    # The telemetry partition of each rank, and the newest stamp read from each partition: a worker
    # behind on one partition gets its ranks' steps late, all together, whatever the others show.
    partition_of: dict[int, int] = field(default_factory=dict)
    partition_ts: dict[int, float] = field(default_factory=dict)
    # Firing conditions that nothing will judge again, (detector, severity, metric, rank, condition,
    # why; None: its rule was removed since the watch was stored, see ``restarts.reform`` for the
    # rest): the next tick resolves them. Not stored: the write after that tick drops them.
    retired: list[tuple[str, str, str, int | None, Condition, str | None]] = field(default_factory=list)
    # rank -> its last batch's (steps, cpu_wait_s), quoted in its cross-rank alerts. Not stored: after
    # a restart the next batches bring it back.
    cpu_waits: dict[int, Series] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-able and versioned. Times on the outage clock are stored as ages at ``clock``: each
        worker's clock has its own outages taken out, so only durations carry over."""
        def age(t: float) -> float | None:
            return None if math.isinf(t) or math.isinf(self.clock) else self.clock - t

        return {
            "version": WATCH_VERSION, "run": self.run, "world_size": self.world_size, "partition": self.partition,
            "tracks": {metric: track.to_dict() for metric, track in self.tracks.items()},
            "stall": None if self.stall is None else self.stall.state_dict(),
            "stall_conditions": {"run" if r is None else str(r): c.to_dict() for r, c in self.stall_conditions.items()},
            "last_step": {str(r): s for r, s in self.last_step.items()},
            "heard": {str(r): t for r, t in self.heard.items()},
            "waits": {str(r): list(w) for r, w in self.waits.items()},
            "latest_ts": None if math.isinf(self.latest_ts) else self.latest_ts,
            "arrived_age_s": age(self.arrived),
            "stepped_age_s": {str(r): age(t) for r, t in self.stepped.items()},
            "partition_of": {str(r): p for r, p in self.partition_of.items()},
            "partition_ts": {str(p): t for p, t in self.partition_ts.items()},
        }

    __json__ = to_dict  # Faust's JSON serializer calls this when the table writes its changelog

    @classmethod
    def from_dict(cls, d: dict, *, rules: Rules, clock: float) -> RunWatch:
        """A stored watch, its ages re-anchored at ``clock`` (this worker's outage clock now): the
        time the run's partition spent between owners is the monitor's own lag, not the ranks'
        silence, so it counts toward no stall. State of rules no longer in ``rules`` is dropped."""
        # Versioned from its first release: a record without a version is not a watch.
        return stored.read(d, lambda f: cls._read(f, rules, clock), version=WATCH_VERSION, what="run watch",
                           error=WatchStateError, unversioned=None)

    @classmethod
    def _read(cls, d: dict, rules: Rules, clock: float) -> RunWatch:

        def back(age: float | None) -> float:
            return -math.inf if age is None else clock - age

        tracks, retired = {}, []
        for metric, track in d["tracks"].items():
            rule = rules.cross_rank_rule(metric)
            if rule is not None:
                tracks[metric] = _Track.from_dict(track, rule)
            else:
                retired += [(CrossRank.name, CrossRank.severity, metric, int(r), Condition(**c), None)
                            for r, c in track["conditions"].items() if c["firing"]]
        stall_conditions = {None if r == "run" else int(r): Condition(**c) for r, c in d["stall_conditions"].items()}
        if rules.stall is None:
            retired += [("stall", Stall.severity, STALL_METRIC, r, c, None) for r, c in stall_conditions.items() if c.firing]
            stall_conditions = {}
        return cls(
            run=d["run"], world_size=d["world_size"], partition=d["partition"], tracks=tracks,
            stall=None if d["stall"] is None or rules.stall is None
            else Stall.from_state(d["stall"]) if rules.stall.fits(d["stall"]) else rules.stall.build(),
            stall_conditions=stall_conditions, retired=retired,
            last_step={int(r): s for r, s in d["last_step"].items()},
            heard={int(r): t for r, t in d["heard"].items()},
            waits={int(r): (w[0], w[1]) for r, w in d["waits"].items()},
            latest_ts=-math.inf if d["latest_ts"] is None else d["latest_ts"],
            arrived=back(d["arrived_age_s"]), stepped={int(r): back(a) for r, a in d["stepped_age_s"].items()},
            clock=clock,
            # added within version 2: a watch stored without them learns them from the next events
            partition_of={int(r): int(p) for r, p in d.get("partition_of", {}).items()},
            partition_ts={int(p): float(t) for p, t in d.get("partition_ts", {}).items()},
        )

    def event_now(self, clock: float) -> float:
        """The run's event-time now (see the module doc); ``clock`` is the outage clock's reading."""
        if math.isinf(self.latest_ts):
            return clock
        return self.latest_ts + max(clock - self.arrived, 0.0)


def tick_mark(watch: RunWatch) -> tuple:
    """What a tick can change, cheap to compare: rows still waiting, and the stall conditions."""
    return (sum(len(t.rows) for t in watch.tracks.values()),
            [(r, c.firing, c.incident, c.streak, c.calm, c.quiet_until) for r, c in watch.stall_conditions.items()])


@dataclass(frozen=True, kw_only=True)
class RunWatcher:
    rules: Rules
    row_wait_s: float = 5.0
    # Rows kept waiting per metric (in memory only); beyond either bound the oldest are scored with
    # what they have. 262,144 cells: 64 steps of 4,096 ranks, one message each at the bench's shape.
    max_rows: int = 256
    max_cells: int = 262_144
    # Shared by every run of the worker; the worker's broker watch stops and starts it.
    outages: OutageClock = field(default_factory=OutageClock)

    def observe(self, watch: RunWatch, progress: RankProgress, now: float) -> list[Alert]:
        """Apply one rank's progress; return the per-rank transitions it completes."""
        if progress.restarted and progress.world_size < watch.world_size:
            restarts.reform(watch, progress.world_size, stall_metric=STALL_METRIC,
                            stall_severity=(self.rules.stall.severity if self.rules.stall else None) or Stall.severity)
        watch.world_size = max(watch.world_size, progress.world_size)
        clock = self.outages.read(now)  # the worker's side of silences is measured on this one
        watch.latest_ts, watch.arrived, watch.clock = max(watch.latest_ts, progress.ts), clock, clock
        at = watch.event_now(clock)
        watch.heard[progress.rank] = progress.ts
        if progress.partition >= 0:
            watch.partition_of[progress.rank] = progress.partition
            watch.partition_ts[progress.partition] = max(watch.partition_ts.get(progress.partition, -math.inf),
                                                         progress.ts)
        # A restarted rank resumed from a checkpoint steps below its old last step, and is stepping:
        # waiting until it passes that step again would be a stall alert on every such restart.
        newer = progress.restarted or progress.last_step > watch.last_step.get(progress.rank, -1)
        if progress.final:
            # Recording its last step means a stray later heartbeat at that step is no sign of life;
            # only a new step (a restarted process) puts the rank back under watch.
            watch.last_step[progress.rank] = max(progress.last_step, watch.last_step.get(progress.rank, -1))
            if watch.stall is not None:
                watch.stall.forget(progress.rank)
        elif newer:
            watch.last_step[progress.rank] = progress.last_step
            if self.rules.stall is not None:
                if watch.stall is None:
                    watch.stall = self.rules.stall.build()
                watch.stall.observe(progress.rank, progress.ts)  # the rank's own time: lag is no gap
                watch.stepped[progress.rank] = clock
        if progress.restarted:
            restarts.resume(watch, progress)
        alerts: list[Alert] = []
        for metric, series in progress.series.items():
            if metric == COLLECTIVE_WAIT:
                if len(series.values):
                    watch.waits[progress.rank] = (float(series.values[-1]), progress.ts)
                continue
            if metric == CPU_WAIT:
                watch.cpu_waits[progress.rank] = series
            rule = self.rules.cross_rank_rule(metric)
            if rule is None:
                continue
            track = watch.tracks.get(metric)
            if track is None:
                track = watch.tracks[metric] = _Track(rule, rule.build())
            last = track.applied.get(progress.rank, -1)
            for step, value in zip(series.steps.tolist(), series.values.tolist()):
                if step <= last:
                    continue  # a replay (at-least-once), or a step this rank already gave
                last = track.applied[progress.rank] = step
                if step <= track.scored:
                    continue  # its row was scored without this rank (waited too long, or too many waiting)
                track.opened.setdefault(step, at)
                track.rows.setdefault(step, {})[progress.rank] = value
            alerts += self._score_ready(watch, metric, track, at, now)
        return alerts

    def tick(self, watch: RunWatch, now: float) -> list[Alert]:
        """Rows whose wait ran out, and ranks that stopped; call this on a timer."""
        run_step = max(watch.last_step.values(), default=-1)
        alerts = [resolve_retired(condition, run=watch.run, rank=rank, metric=metric, detector=detector,
                                  severity=severity, value=math.nan, now=now, why=why,
                                  step=run_step if rank is None else watch.last_step.get(rank, run_step))
                  for detector, severity, metric, rank, condition, why in watch.retired]
        watch.retired = []
        clock = watch.clock = self.outages.read(now)
        at = watch.event_now(clock)
        for metric, track in watch.tracks.items():
            alerts += self._score_ready(watch, metric, track, at, now)
        if watch.stall is not None and self.rules.stall is not None:
            stalled, cause, why = self._stalls(watch, watch.stall, at, clock)
            rule = self.rules.stall
            policy = AlertPolicy(for_=rule.for_, resolve_after=rule.resolve_after, cooldown=rule.cooldown)
            for rank in set(watch.stall_conditions) | set(stalled):
                s = stalled.get(rank)
                found = policy.apply(
                    watch.stall_conditions.setdefault(rank, Condition()),
                    run=watch.run, rank=rank, metric=STALL_METRIC, detector="stall",
                    severity=rule.severity or Stall.severity,
                    steps=np.array([run_step if rank is None or rank in cause else watch.last_step.get(rank, -1)]),
                    values=np.array([s.silent_s if s else 0.0]), scores=np.array([s.score if s else 0.0]),
                    anomalous=np.array([s is not None]), now=now,
                )
                if rank in cause:
                    found = [replace(a, message=f"{a.message}: {why}") if a.status == "firing" else a for a in found]
                alerts += found
        return alerts

    @staticmethod
    def _stalls(watch: RunWatch, stall: Stall, now: float, clock: float) -> tuple[dict[int | None, Stalled], list[int], str]:
        """Stalled ranks (``None``: the run) at event time ``now``; for a whole-run stall, the ranks
        that caused it and why. ``clock``: the outage clock, for how long since a rank's step arrived."""
        # Silent both ways: by the ranks' own stamps, and with no new step arriving for the bound (from
        # the rank, or for the whole run from any rank: one rank's backlog arriving is no stall).
        last_arrival = max(watch.stepped.values(), default=-math.inf)
        stalled = {s.rank: s for s in stall.check(now)
                   if clock - (last_arrival if s.rank is None else watch.stepped.get(s.rank, -math.inf)) >= s.bound_s}
        # And, for a rank, by its partition: the other ranks on it have been read a bound past its last
        # step. A worker far behind on one partition (a backlog of thousands of ranks) can go longer
        # than a bound without reaching it while it reads the others; its ranks are late, not stalled.
        # A rank alone on its partition (or on one not known) has no such witnesses: the rule above decides.
        sharing = Counter(watch.partition_of.values())
        for rank in [r for r in stalled if r is not None]:
            p = watch.partition_of.get(rank)
            if p is not None and sharing[p] > 1 and (
                    watch.partition_ts[p] - stall.last_seen.get(rank, math.inf) < stalled[rank].bound_s):
                del stalled[rank]
        run = stalled.pop(None, None)
        if run is None:
            return stalled, [], ""
        last_step_at = stall.last_seen
        ranks = sorted(last_step_at)
        silent = [r for r in ranks if now - watch.heard.get(r, -math.inf) >= SILENT_FRACTION * run.bound_s]
        waiting = [
            r for r in ranks if r in watch.waits and watch.waits[r][1] > last_step_at[r]
            and watch.waits[r][0] >= max(MIN_BLOCKED_S, 0.5 * (watch.waits[r][1] - last_step_at[r]))
        ]
        if 0 < len(silent) < len(ranks):
            cause, why = silent, "its heartbeats stopped as well, while other ranks' go on"
        elif 0 < len(waiting) < len(ranks):
            cause = [r for r in ranks if r not in waiting]
            why = f"{'rank' if len(waiting) == 1 else 'ranks'} {ranks_text(waiting)} blocked in a collective, waiting"
        else:
            cause, why = [], ""
        for rank in cause:
            stalled[rank] = run._replace(rank=rank, silent_s=max(now - last_step_at[rank], 0.0))
        if not cause or watch.stall_conditions.get(None, Condition()).firing:
            stalled[None] = run  # no one to blame, or the run-wide alert is out already: it stays until steps resume
        return stalled, cause, why

    def _score_ready(self, watch: RunWatch, metric: str, track: _Track, at: float, now: float) -> list[Alert]:
        """Score the rows complete, or waiting ``row_wait_s`` by event time ``at``; alerts stamped ``now``."""
        n = watch.world_size
        waiting = sorted(track.rows)
        overflow = len(waiting) - max(2, min(self.max_rows, self.max_cells // max(n, 1)))
        # In step order: a rank gives its steps in order, so once a later row is complete or overdue
        # the ranks missing from an earlier one have moved on without giving it.
        due = [i for i, step in enumerate(waiting)
               if i < overflow or len(track.rows[step]) >= n or at - track.opened[step] >= self.row_wait_s]
        ready = waiting[: due[-1] + 1] if due else []
        alerts: list[Alert] = []
        rule = track.rule
        policy = AlertPolicy(for_=rule.for_, resolve_after=rule.resolve_after, cooldown=rule.cooldown)
        for step in ready:
            row = track.rows.pop(step)
            track.opened.pop(step, None)
            track.scored = step
            values = np.full(n, np.nan)
            ranks = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
            inside = ranks < n
            values[ranks[inside]] = np.fromiter(row.values(), dtype=np.float64, count=len(row))[inside]
            scores = track.detector.update(values)
            flagged = track.detector.decide(scores)
            # Conditions exist only for ranks that have been anomalous: the rest need no policy step.
            for rank in sorted(set(track.conditions).union(np.flatnonzero(flagged).tolist())):
                if rank >= n:
                    continue
                found = policy.apply(
                    track.conditions.setdefault(rank, Condition()),
                    run=watch.run, rank=rank, metric=metric, detector=track.detector.name,
                    severity=rule.severity or track.detector.severity, steps=np.array([step]),
                    values=values[rank : rank + 1], scores=scores[rank : rank + 1],
                    anomalous=flagged[rank : rank + 1], now=now,
                )
                alerts += _with_cpu_wait(found, watch.cpu_waits.get(rank), step)
        return alerts


def _with_cpu_wait(alerts: list[Alert], waited: Series | None, step: int) -> list[Alert]:
    """Firing ``alerts`` of a rank that waited ``CPU_NOTED_S`` or more for a CPU at ``step`` say so: a
    rank its host starves of CPU holds its peers up as a slow one does (its compute time leaves the
    wait out, but not its peers' wait for it), and the cause to look for is then the host."""
    if waited is None or not alerts:
        return alerts
    at = np.flatnonzero(waited.steps == step)
    if not len(at) or not waited.values[at[0]] >= CPU_NOTED_S:
        return alerts
    note = (f"; rank {alerts[0].rank} waited {waited.values[at[0]] * 1e3:.0f} ms for a CPU at this step ({CPU_WAIT}): "
            "its host may be short of CPU")
    return [replace(a, message=a.message + note) if a.status == "firing" else a for a in alerts]
