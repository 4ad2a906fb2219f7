"""A run's evaluations over time: regression, alert transitions, the suggested eval interval.

Different evaluations of one run land on different partitions (shards are keyed ``run/eval_id``),
so their non-provisional reports are re-keyed by run (``RunUpdate``) and meet here: one
``RunState`` per run, one writer for every eval alert of the run. A condition (detector, metric,
rank) fires once, stays quiet while later evaluations still show it, and resolves on the first
evaluation that checked it again and found nothing. Only the newest evaluation (by step) moves
conditions; a late amendment of an older one only updates the history.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from rankwatch.contract import Alert, Control, EvalReport
from rankwatch.contract.internal import Finding, RunUpdate
from rankwatch.stream_processors.evaluation.progressive import IntervalAdvisor
from rankwatch.stream_processors import stored
from rankwatch.stream_processors.evaluation.state import EVAL_STATE_VERSION, EvalStateError
from rankwatch.stream_processors.evaluation.stats import Summary, compare


@dataclass
class RunState:
    #: Complete reports, oldest first: {"eval_id", "step", "revision", "metrics": {name: Summary dict}}.
    history: list[dict] = field(default_factory=list)
    latest_step: int | None = None
    #: Firing conditions by alert key: {"incident", "detector", "metric", "rank", "baseline"}.
    firing: dict[str, dict] = field(default_factory=dict)
    interval: int | None = None  # last suggested eval interval

    def to_dict(self) -> dict:
        return {"version": EVAL_STATE_VERSION, "history": self.history, "latest_step": self.latest_step,
                "firing": self.firing, "interval": self.interval}

    __json__ = to_dict

    @classmethod
    def from_dict(cls, d: dict | None) -> RunState:
        if not d:
            return cls()
        return stored.read(d, lambda f: cls(**f), version=EVAL_STATE_VERSION, what="eval run state",
                           error=EvalStateError)


@dataclass(frozen=True)
class RunOutput:
    alerts: list[Alert]
    controls: list[Control]


@dataclass(frozen=True, kw_only=True)
class RunTracker:
    alpha: float = 0.001
    lower_is_better: frozenset[str] = frozenset()
    primary_metric: str = "correct"
    advisor: IntervalAdvisor | None = IntervalAdvisor()
    max_history: int = 32

    def apply(self, state: RunState, update: RunUpdate, now: float) -> RunOutput:
        """Fold one non-provisional report into ``state`` in place; return alert transitions and advice."""
        report = update.report
        current = state.latest_step is None or report.step >= state.latest_step
        previous = self._previous(state, report)
        if report.complete:
            self._remember(state, report)
        if not current:
            return RunOutput([], [])
        state.latest_step = report.step
        findings, evaluated = list(update.findings), set(update.evaluated)
        if report.complete:
            for name in report.metrics:
                evaluated.add(("eval_regression", name))
                found = self._regression(state, report, name, previous.get(name))
                if found:
                    findings.append(found)
        alerts = self._transitions(state, report, findings, evaluated, previous, now)
        controls = self._advise_interval(state, report, now) if report.complete else []
        return RunOutput(alerts, controls)

    # -- regression -------------------------------------------------------------------------------

    def _previous(self, state: RunState, report: EvalReport) -> dict[str, dict]:
        """Each metric's summary in the newest complete report before this one's step."""
        before = [h for h in state.history if h["step"] < report.step and h["eval_id"] != report.eval_id]
        return before[-1]["metrics"] if before else {}

    def _regression(self, state: RunState, report: EvalReport, name: str, previous: dict | None) -> Finding | None:
        key = Alert.make_key(report.run, "eval_regression", name)
        baseline = state.firing[key]["baseline"] if key in state.firing else previous
        if not baseline:
            return None
        old, new = Summary.from_dict(baseline), Summary.from_dict(report.metrics[name])
        if not (math.isfinite(old.mean) and math.isfinite(new.mean)):
            return None
        lower = any(fnmatch.fnmatchcase(name, pattern) for pattern in self.lower_is_better)
        result = compare(old, new, higher_is_better=not lower)
        if result.p_value >= self.alpha:
            return None
        return Finding(
            "eval_regression", name, None, new.mean, 1.0 - result.p_value, "warning",
            f"eval {report.eval_id} (step {report.step}): {name} = {new.mean:.4g} vs {old.mean:.4g} before, "
            f"a significant drop ({result.test}, one-sided p = {result.p_value:.2g})",
        )

    # -- transitions ------------------------------------------------------------------------------

    def _transitions(self, state: RunState, report: EvalReport, findings: list[Finding],
                     evaluated: set[tuple[str, str]], previous: dict[str, dict], now: float) -> list[Alert]:
        alerts, seen = [], set()
        for f in findings:
            key = Alert.make_key(report.run, f.detector, f.metric, f.rank)
            seen.add(key)
            if key in state.firing:
                continue
            state.firing[key] = {"incident": report.step, "detector": f.detector, "metric": f.metric,
                                 "rank": f.rank,
                                 "baseline": previous.get(f.metric) if f.detector == "eval_regression" else None}
            alerts.append(Alert(
                key=key, run=report.run, status="firing", severity=f.severity, detector=f.detector,
                metric=f.metric, rank=f.rank, step=report.step, value=f.value, message=f.message, ts=now,
                score=min(1.0, max(0.0, f.score)), incident=report.step, ranks=() if f.rank is None else (f.rank,),
            ))
        for key, cond in list(state.firing.items()):
            if key in seen or (cond["detector"], cond["metric"]) not in evaluated:
                continue
            del state.firing[key]
            mean = report.metrics.get(cond["metric"], {}).get("mean", math.nan)
            who = "" if cond["rank"] is None else f" on rank {cond['rank']}"
            alerts.append(Alert(
                key=key, run=report.run, status="resolved", severity="info", detector=cond["detector"],
                metric=cond["metric"], rank=cond["rank"], step=report.step,
                value=mean if cond["detector"] != "eval_coverage" else 0.0,
                message=f"eval {report.eval_id} (step {report.step}): {cond['detector']} on {cond['metric']}{who} "
                        f"no longer seen", ts=now, score=0.0, incident=cond["incident"],
                ranks=() if cond["rank"] is None else (cond["rank"],),
            ))
        return alerts

    # -- adaptive frequency -----------------------------------------------------------------------

    def _advise_interval(self, state: RunState, report: EvalReport, now: float) -> list[Control]:
        if self.advisor is None:
            return []
        points = [(h["step"], Summary.from_dict(h["metrics"][self.primary_metric]))
                  for h in state.history if self.primary_metric in h["metrics"]]
        advice = self.advisor.suggest([s for s, _ in points], [m.mean for _, m in points],
                                      [m.stderr for _, m in points])
        if advice is None or advice.interval == state.interval:
            return []
        state.interval = advice.interval
        return [Control(run=report.run, action="set_eval_interval", eval_id=None, value=float(advice.interval),
                        reason=f"{self.primary_metric}: {advice.reason}", ts=now)]

    def _remember(self, state: RunState, report: EvalReport) -> None:
        known = next((h for h in state.history if h["eval_id"] == report.eval_id), None)
        if known is not None and known["revision"] >= report.revision:
            return  # a redelivered older revision
        entry = {"eval_id": report.eval_id, "step": report.step, "revision": report.revision,
                 "metrics": {name: dict(s) for name, s in report.metrics.items()}}
        kept = [h for h in state.history if h["eval_id"] != report.eval_id]
        state.history = sorted([*kept, entry], key=lambda h: h["step"])[-self.max_history:]
