"""Everything the telemetry flow does to one batch, as a pure function of (state, batch).

One ``RankState`` per (run, rank) holds the dedup cursor, each metric's detectors, alert conditions
and open rollup window. It serialises to one JSON-able dict, which the Faust flow keeps in a table
keyed like the telemetry topic, so state and stream share partitions and one writer owns each key.

The stored dict is versioned (``STATE_VERSION``), so that workers of two releases on one changelog,
during a rolling upgrade or after a rollback, read each other's state or reject it, never misread it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from rankwatch.contract import COLLECTIVE_WAIT, CPU_WAIT, Alert, Rollup, Series, TelemetryBatch
from rankwatch.errors import RankwatchError
from rankwatch.stream_processors import late, stored
from rankwatch.stream_processors.detectors import Detector, NonFinite
from rankwatch.stream_processors.detectors.calibration import fit_due
from rankwatch.stream_processors.policies import AlertPolicy, Condition, resolve_retired
from rankwatch.stream_processors.rules import Rule, Rules, default_rules, detector_classes
from rankwatch.stream_processors.windows import Window, roll, roll_one


#: Layout of ``RankState.to_dict``. Raise it when a stored field changes meaning or goes away; a
#: field added with a default needs no new version (an older state reads, taking the default). A
#: state stored without a version was written before versions existed, in version 1's layout.
STATE_VERSION = 1


class RankStateError(RankwatchError, ValueError):
    """A stored rank state this worker cannot read: another version, or fields its detectors do not take."""


@dataclass
class MetricState:
    detectors: dict[str, Detector]
    conditions: dict[str, Condition] = field(default_factory=dict)
    window: Window | None = None
    # The rules ``detectors`` were last checked against (not stored): the same object as the
    # processor's plan for the metric needs no check of the detectors' names.
    rules: dict[str, Rule] | None = field(default=None, repr=False, compare=False)
    # While a rank's messages are missing (``late``): the windows closed since, by index, and the
    # lowest index a late point may join (below the open window: kept, or never had a point).
    kept: dict[int, Window] = field(default_factory=dict)
    kept_from: int | None = None

    def to_dict(self) -> dict:
        d = {
            "detectors": {name: d.state_dict() for name, d in self.detectors.items()},
            # ``Condition.to_dict`` is ``dataclasses.asdict``, whose deep copy costs more than the rest of
            # this state together; a condition's fields are plain numbers, so its ``__dict__`` is the same.
            "conditions": {name: dict(c.__dict__) for name, c in self.conditions.items()},
            "window": self.window.to_dict() if self.window else None,
        }
        if self.kept_from is not None:  # rare, and absent is what an older worker wrote
            d["kept_from"], d["kept"] = self.kept_from, [w.to_dict() for w in self.kept.values()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MetricState:
        kept = [Window.from_dict(w) for w in d.get("kept", ())]
        return cls(
            detectors={name: detector_classes()[name].from_state(s) for name, s in d["detectors"].items()},
            conditions={name: Condition(**c) for name, c in d["conditions"].items()},
            window=Window.from_dict(d["window"]) if d["window"] else None,
            kept={w.index: w for w in kept}, kept_from=d.get("kept_from"),
        )


@dataclass
class RankState:
    producer: str = ""
    seq: int = -1
    metrics: dict[str, MetricState] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # seqs below ``seq`` not applied yet (``late``)
    retired: dict[str, int] = field(default_factory=dict)  # earlier incarnations' last seqs (``late``)
    # Since the rank restarted, the metrics whose first point has not come: it may rewind (``_rewound``).
    resuming: set[str] = field(default_factory=set)

    def to_dict(self) -> dict:
        d = {"version": STATE_VERSION, "producer": self.producer, "seq": self.seq,
             "metrics": {m: s.to_dict() for m, s in self.metrics.items()}}
        if self.missing:
            d["missing"] = self.missing
        if self.retired:
            d["retired"] = self.retired
        if self.resuming:
            d["resuming"] = sorted(self.resuming)
        return d

    __json__ = to_dict  # Faust's JSON serializer calls this when the table writes its changelog

    @classmethod
    def from_dict(cls, d: dict | None) -> RankState:
        """The state ``to_dict`` stored; RankStateError if this worker cannot read it (``salvage`` then)."""
        if not d:
            return cls()
        return stored.read(
            d, lambda f: cls(f["producer"], f["seq"], {m: MetricState.from_dict(s) for m, s in f["metrics"].items()},
                             [int(s) for s in f.get("missing", ())],
                             {str(p): int(s) for p, s in f.get("retired", {}).items()},
                             {str(m) for m in f.get("resuming", ())}),
            version=STATE_VERSION, what="rank state", error=RankStateError)

    @classmethod
    def salvage(cls, d: object) -> RankState:
        """What is kept of a state ``from_dict`` rejects: the dedup cursor, when it reads as one. The
        messages it records were applied and their outputs sent; only what was learned starts over."""
        producer, seq = (d.get("producer"), d.get("seq")) if isinstance(d, dict) else (None, None)
        return cls(producer, seq) if type(producer) is str and type(seq) is int else cls()


@dataclass(frozen=True)
class Output:
    alerts: list[Alert]
    rollups: list[Rollup]
    last_step: int | None = None  # the highest step in the batch; None for a replay or no points
    # values stage 2 compares across ranks: cross-rank rules' metrics, and who waits in a collective
    cross_rank: dict[str, Series] = field(default_factory=dict)
    arrived_late: bool = False  # a message that came after later ones of its rank: rollups only (``late``)
    restarted: bool = False  # the first message of a new incarnation of a rank seen before
    learned: list[Detector] = field(default_factory=list, compare=False, repr=False)  # for ``fit_due_models``


@dataclass(frozen=True, kw_only=True)
class TelemetryProcessor:
    rollup_steps: int = 50
    rules: Rules = field(default_factory=default_rules)
    # metric -> (its per-rank rules by detector, whether stage 2 reads it (compares it across ranks,
    # or quotes it in their alerts), whether ``nonfinite`` is its only rule: most metrics a trainer
    # logs are such plain gauges)
    _plans: dict[str, tuple[dict[str, Rule], bool, bool]] = field(default_factory=dict, repr=False, compare=False)

    def _plan(self, metric: str) -> tuple[dict[str, Rule], bool, bool]:
        found = self._plans.get(metric)
        if found is None:
            cross = metric in (COLLECTIVE_WAIT, CPU_WAIT) or self.rules.cross_rank_rule(metric) is not None
            rules = self.rules.for_metric(metric)
            found = self._plans[metric] = (rules, cross, rules.keys() == {NonFinite.name})
        return found

    def is_replay(self, state: RankState, batch: TelemetryBatch) -> bool:
        """At-least-once delivery replays messages; a seq we already applied changes nothing.

        A new ``producer`` id is a restarted rank whose numbering starts again, never a replay; a seq
        that a later message skipped is late (``late``), not a replay; an earlier incarnation's seq
        is a replay up to the last one applied (``late.retire``).
        """
        if batch.producer != state.producer:
            return batch.seq <= state.retired.get(batch.producer, -1)
        return batch.seq <= state.seq and not late.is_late(state, batch.producer, batch.seq)

    def process(self, state: RankState, batch: TelemetryBatch, now: float) -> Output:
        """Apply one batch to ``state`` in place; return the alerts and closed rollups it produced."""
        alerts: list[Alert] = []
        rollups: list[Rollup] = []
        if batch.producer == state.producer and batch.seq <= state.seq:
            if late.is_late(state, batch.producer, batch.seq):
                rollups = self._late(state, batch, now)
                late.found(state, batch.seq)  # after: with nothing else missing, the kept windows go
                return Output(alerts, rollups, arrived_late=True)
            return Output(alerts, rollups)
        if batch.producer in state.retired:  # an earlier incarnation's message, after the next one began
            if batch.seq <= state.retired[batch.producer]:
                return Output(alerts, rollups)
            state.retired[batch.producer] = batch.seq
            return Output(alerts, self._late(state, batch, now), arrived_late=True)
        restarted = bool(state.producer) and batch.producer != state.producer
        if restarted:
            late.retire(state)
            state.resuming = set(state.metrics)
        resuming = state.resuming
        if batch.seq != state.seq + 1 or batch.producer != state.producer or state.missing:
            late.note_skipped(state, batch.producer, batch.seq)
        state.producer, state.seq = batch.producer, batch.seq
        cross: dict[str, Series] = {}
        learned: list[Detector] = []
        last_step: int | None = None
        plans, metrics, width = self._plans, state.metrics, self.rollup_steps
        for metric, series in batch.series.items():
            rules, compared, gauge = plans.get(metric) or self._plan(metric)
            if compared:
                cross[metric] = series
            steps, values = series.steps, series.values
            # One step per message is the usual case: its step and value as plain numbers, once.
            one = (int(steps[0]), float(values[0])) if len(steps) == 1 else None
            if len(steps):
                top = one[0] if one is not None else int(steps.max())
                last_step = top if last_step is None else max(last_step, top)
            ms = metrics.get(metric)
            # Most metrics a trainer logs are plain gauges, and at one step a message the loop below
            # was most of the per-message cost: a finite point of a quiet gauge whose rules stand and
            # whose open window it falls in changes that window only.
            if (gauge and one is not None and ms is not None and ms.rules is rules and not ms.conditions
                    and (window := ms.window) is not None and one[0] // width == window.index
                    and math.isfinite(one[1]) and not (resuming and metric in resuming)):
                window.add_one(*one)
                continue
            if ms is None:
                ms = state.metrics[metric] = MetricState(detectors={n: r.build() for n, r in rules.items()}, rules=rules,
                                                         kept_from=0 if state.missing else None)
            elif ms.rules is not rules:
                for name, detector in ms.detectors.items():  # a rule edited since: learn afresh with its parameters
                    if name in rules and rules[name].params and not rules[name].fits(detector.state_dict()):
                        ms.detectors[name] = rules[name].build()
                if ms.detectors.keys() != rules.keys():  # the rules changed since this state was built
                    for name, detector, condition in _follow_rules(ms, rules):
                        step, value = (int(steps[0]), float(values[0])) if len(steps) else (condition.incident, math.nan)
                        alerts.append(resolve_retired(
                            condition, run=batch.run, rank=batch.rank, metric=metric, detector=name,
                            severity=detector.severity, step=step, value=value, now=now))
                ms.rules = rules
            if resuming and metric in resuming:
                resuming.discard(metric)
                if _rewound(ms.window, steps):
                    rollups.append(self._rollup(batch, metric, ms.window, now))
                    ms.window = None
                    for name, detector in ms.detectors.items():
                        if detector.level_relative:
                            ms.detectors[name] = rules[name].build()
            # One check per series instead of one per stateless detector: nearly every series is all
            # finite, and at one step per message numpy's fixed cost per call is most of the work.
            finite = math.isfinite(one[1]) if one is not None else _all_finite(values)
            # A finite point of a gauge with no condition changes nothing but its window.
            for name, detector in () if finite and gauge and not ms.conditions else ms.detectors.items():
                rule = rules[name]
                # A condition is made when it first sees an anomaly: a quiet one is the default.
                condition = ms.conditions.get(name)
                if finite and type(detector) is NonFinite and (condition is None or not condition.firing):
                    if condition is not None:
                        condition.streak = 0  # what the quiet branch below does with all-zero scores
                    continue
                scores = detector.update(values)
                learned.append(detector)
                anomalous = detector.decide(scores)
                if (condition is None or not condition.firing) and not anomalous.any():
                    # What the policy does to a quiet condition over normal points, without its loop.
                    if condition is not None and len(anomalous):
                        condition.streak = 0
                    continue
                if condition is None:
                    condition = ms.conditions[name] = Condition()
                policy = AlertPolicy(for_=rule.for_, resolve_after=rule.resolve_after, cooldown=rule.cooldown)
                alerts += policy.apply(
                    condition,
                    run=batch.run, rank=batch.rank, metric=metric, detector=name,
                    severity=rule.severity or detector.severity, steps=steps, values=values,
                    scores=scores, anomalous=anomalous, now=now,
                )
            if one is not None:
                ms.window, closed = roll_one(ms.window, *one, self.rollup_steps)
            else:
                ms.window, closed = roll(ms.window, steps, values, self.rollup_steps)
            if closed:
                late.keep(ms, closed)
                rollups += [self._rollup(batch, metric, w, now) for w in closed]
        if batch.final:
            # The rank closes: its open windows would never close, so send them now. They stay open: a
            # rank that carries on (restarted) sends the window again, complete, and that rollup wins.
            rollups += [self._rollup(batch, metric, ms.window, now)
                        for metric, ms in state.metrics.items() if ms.window is not None]
        return Output(alerts, rollups, last_step, cross, restarted=restarted, learned=learned)

    def _late(self, state: RankState, batch: TelemetryBatch, now: float) -> list[Rollup]:
        """A message that came after later ones of its rank or of a later incarnation: its points to the
        rollups (``late``)."""
        resend = []
        for metric, series in batch.series.items():
            ms = state.metrics.get(metric)
            if ms is None:
                rules = self._plan(metric)[0]
                ms = state.metrics[metric] = MetricState(detectors={n: r.build() for n, r in rules.items()},
                                                         rules=rules, kept_from=0)
            resend += [(metric, w) for w in late.roll_late(ms, series.steps, series.values, self.rollup_steps)]
        return [self._rollup(batch, metric, w, now) for metric, w in resend]

    def _rollup(self, batch: TelemetryBatch, metric: str, window: Window, now: float) -> Rollup:
        return window.to_rollup(run=batch.run, rank=batch.rank, metric=metric, width=self.rollup_steps, now=now,
                                world_size=batch.world_size)


def fit_due_models(learned: Iterable[Detector]) -> None:
    """The refits that came due while the detectors ``learned`` (``Output.learned``), as one fit
    (``calibration.fit_due``): call it after a batch of messages, so that each detector's next point
    finds its model fitted. Only those: going over every detector of every rank in the batch cost
    more than the fits, most of a rank's metrics being plain gauges."""
    fit_due(m for d in learned for m in d.tail_models())


def _follow_rules(ms: MetricState, rules: dict[str, Rule]) -> list[tuple[str, Detector, Condition]]:
    """A detector whose rule is gone retires with its condition; a new rule's detector starts learning.
    Returns the retired detectors whose condition was firing: nothing else would ever resolve it."""
    firing = []
    for name in [n for n in ms.detectors if n not in rules]:
        detector, condition = ms.detectors.pop(name), ms.conditions.pop(name, None)
        if condition is not None and condition.firing:
            firing.append((name, detector, condition))
    for name, rule in rules.items():
        if name not in ms.detectors:
            ms.detectors[name] = rule.build()
    return firing


def _rewound(window: Window | None, steps: np.ndarray) -> bool:
    """Whether a restarted rank's first points of a metric go back to steps its open window saw:
    resumed from an earlier checkpoint. That window, as the last incarnation left it, is sent, and
    the steps are rolled up afresh: the repeated steps' rollups are the new incarnation's, and win
    (else they would join the old points of the same steps, or be dropped below the open window).
    The detectors that judge a point against recent values learn afresh too: to them, going back to
    the checkpoint's values (a loss higher again, a grad norm a hundred times larger) is an anomaly,
    and every such restart would be a false alert."""
    return (window is not None and window.last_step is not None and len(steps) > 0
            and int(steps.min()) <= window.last_step)


def _all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite (a finite sum says so; one that overflows takes the long way)."""
    return math.isfinite(float(np.add.reduce(values))) or bool(np.isfinite(values).all())
