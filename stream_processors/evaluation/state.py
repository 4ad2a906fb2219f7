"""Merging one evaluation's shards into global reports, as a pure function of (state, shard, clock).

One ``EvalState`` per (run, eval_id) keeps every sample's values by sample id, so a replayed or
duplicated chunk adds nothing, and the same id from two ranks is seen as a coverage duplicate. It
serialises to one JSON-able dict for a Faust table keyed like the shards (``run/eval_id``).

Reports go out, each with a higher ``revision``:

- provisional ones while chunks stream in, at most one per ``provisional_interval_s``;
- the final one when every rank sent its ``last`` chunk, or at ``deadline_s`` after the first
  shard with ``complete: false`` and the missing ranks;
- amended ones when data arrives after that (at once when a rank finishes, else throttled).

Every non-provisional report also leaves as a ``RunUpdate`` with its consistency and coverage
findings, for the run's own partition to turn into alerts (see ``runs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rankwatch.contract import Control, EvalReport, EvalShard, encode_float
from rankwatch.contract.codec import decode_float
from rankwatch.contract.internal import Finding, RunUpdate
from rankwatch.errors import RankwatchError
from rankwatch.stream_processors import stored
from rankwatch.stream_processors.evaluation.progressive import StopRule
from rankwatch.stream_processors.evaluation.stats import composite, consistency, summarize

#: Id lists in a report are capped at this length; the counts are exact.
MAX_IDS = 100


class ShardRejected(RankwatchError, ValueError):
    """A shard that contradicts its evaluation (another world size or step)."""


#: Layout of the stored eval states (``EvalState`` and the eval runs' ``RunState``); a state stored
#: without a version has version 1's. Raise it when a stored field changes meaning or goes away.
EVAL_STATE_VERSION = 1


class EvalStateError(RankwatchError, ValueError):
    """A stored eval state this worker cannot read (another release's layout): never guess at it."""


@dataclass
class EvalState:
    run: str = ""
    eval_id: str = ""
    step: int = 0
    world_size: int = 0
    dataset_size: int | None = None
    partition: int | None = None  # of the shards; the deadline timer only ticks partitions it owns
    ids: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # rank that sent each sample first
    values: dict[str, list[float]] = field(default_factory=dict)  # aligned with ids; NaN = not sent
    done: list[int] = field(default_factory=list)  # ranks whose last chunk arrived
    duplicates: list[list[int]] = field(default_factory=list)  # [sample id, first rank, other rank]
    revision: int = 0
    first_seen: float = 0.0
    last_change: float = 0.0
    last_emit: float = 0.0
    finalized: str = ""  # "", "deadline" or "complete": which final report went out
    dirty: bool = False  # data arrived since the last report
    stop_advised: bool = False
    closed: bool = False  # past retention: samples dropped, later shards ignored
    _index: dict[int, int] | None = field(default=None, repr=False, compare=False)
    _dup_seen: set[tuple[int, int]] | None = field(default=None, repr=False, compare=False)

    @property
    def missing_ranks(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self.done))

    @property
    def complete(self) -> bool:
        return self.world_size > 0 and not self.missing_ranks

    def index(self) -> dict[int, int]:
        if self._index is None:
            self._index = {sid: i for i, sid in enumerate(self.ids)}
        return self._index

    def dup_seen(self) -> set[tuple[int, int]]:
        if self._dup_seen is None:
            self._dup_seen = {(sid, other) for sid, _, other in self.duplicates}
        return self._dup_seen

    def to_dict(self) -> dict:
        return {
            "version": EVAL_STATE_VERSION,
            "run": self.run, "eval_id": self.eval_id, "step": self.step, "world_size": self.world_size,
            "dataset_size": self.dataset_size, "partition": self.partition, "ids": self.ids,
            "owners": self.owners,
            # JSON has no NaN; "not sent" is the common NaN here, so it is spelled the contract's way.
            "values": {m: [encode_float(v) for v in vs] for m, vs in self.values.items()},
            "done": self.done, "duplicates": self.duplicates, "revision": self.revision,
            "first_seen": self.first_seen, "last_change": self.last_change, "last_emit": self.last_emit,
            "finalized": self.finalized, "dirty": self.dirty, "stop_advised": self.stop_advised,
            "closed": self.closed,
        }

    __json__ = to_dict  # Faust's JSON serializer calls this when the table writes its changelog

    @classmethod
    def from_dict(cls, d: dict | None) -> EvalState:
        if not d:
            return cls()

        def fields(f: dict) -> EvalState:
            values = {m: [decode_float(v) for v in vs] for m, vs in f.pop("values", {}).items()}
            return cls(**f, values=values)

        return stored.read(d, fields, version=EVAL_STATE_VERSION, what="eval state", error=EvalStateError)


@dataclass(frozen=True)
class EvalOutput:
    reports: list[EvalReport] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)
    updates: list[RunUpdate] = field(default_factory=list)  # for the run's partition
    changed: bool = False  # the state must be written back


@dataclass(frozen=True, kw_only=True)
class EvalProcessor:
    deadline_s: float = 60.0
    provisional_interval_s: float = 1.0
    retention_s: float = 3600.0
    primary_metric: str = "correct"
    stop_rule: StopRule | None = StopRule()
    alpha: float = 0.001
    composite_weights: tuple[tuple[str, float], ...] = (("correct", 1.0),)

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.provisional_interval_s < 0 or self.retention_s <= 0:
            raise ValueError("deadline_s and retention_s must be > 0, provisional_interval_s >= 0")
        if not 0 < self.alpha < 1:
            raise ValueError("alpha must be in (0, 1)")

    # -- input ------------------------------------------------------------------------------------

    def apply(self, state: EvalState, shard: EvalShard, now: float) -> EvalOutput:
        """Merge ``shard`` into ``state`` in place; return what it causes."""
        if state.closed:
            return EvalOutput()
        if not state.world_size:
            state.run, state.eval_id, state.step = shard.run, shard.eval_id, shard.step
            state.world_size, state.first_seen = shard.world_size, now
        elif (shard.world_size, shard.step) != (state.world_size, state.step):
            raise ShardRejected(
                f"shard of {shard.run}/{shard.eval_id} from rank {shard.rank} says world_size "
                f"{shard.world_size}, step {shard.step}; the evaluation has {state.world_size}, {state.step}"
            )
        if shard.dataset_size is not None:
            state.dataset_size = shard.dataset_size
        added, new_dups = _merge(state, shard)
        finished = shard.last and shard.rank not in state.done
        if finished:
            state.done = sorted({*state.done, shard.rank})
        if not (added or new_dups or finished):
            return EvalOutput()  # a replay: nothing changes, nothing is re-sent
        state.dirty, state.last_change = True, now
        out = EvalOutput(changed=True)
        if (state.complete and state.finalized != "complete") or (finished and state.finalized):
            self._emit(state, now, out, final=True)  # the final report, or a rank amending it
        elif now - state.last_emit >= self.provisional_interval_s:
            self._emit(state, now, out, final=bool(state.finalized))
        self._advise_stop(state, now, out)
        return out

    def tick(self, state: EvalState, now: float) -> EvalOutput:
        """Deadlines, throttled reports and retention; call it every second or so."""
        if state.closed or not state.world_size:
            return EvalOutput()
        out = EvalOutput(changed=False)
        if not state.finalized and now - state.first_seen >= self.deadline_s:
            self._emit(state, now, out, final=True)
        elif state.dirty and now - state.last_emit >= self.provisional_interval_s:
            self._emit(state, now, out, final=bool(state.finalized))
        elif state.finalized and now - state.last_change >= self.retention_s:
            _close(state)
            return EvalOutput(changed=True)
        return EvalOutput(out.reports, out.controls, out.updates, changed=bool(out.reports))

    # -- output -----------------------------------------------------------------------------------

    def _emit(self, state: EvalState, now: float, out: EvalOutput, *, final: bool) -> None:
        state.revision += 1
        state.last_emit, state.dirty = now, False
        if final:
            state.finalized = "complete" if state.complete else (state.finalized or "deadline")
        report = self.report(state, now, provisional=not final)
        out.reports.append(report)
        if final:
            out.updates.append(self.findings(state, report))

    def report(self, state: EvalState, now: float, *, provisional: bool) -> EvalReport:
        """The report of ``state`` as it stands (no state change)."""
        owners = np.asarray(state.owners, dtype=np.int64)
        metrics, per_rank = {}, {}
        for name, column in state.values.items():
            values = np.asarray(column, dtype=np.float64)
            metrics[name] = summarize(values).to_dict()
            for rank in np.unique(owners).tolist():
                mine = values[owners == rank]
                mine = mine[np.isfinite(mine)]
                per_rank.setdefault(str(rank), {})[name] = {
                    "n": int(mine.size), "mean": float(mine.mean()) if mine.size else math.nan,
                }
        return EvalReport(
            run=state.run, eval_id=state.eval_id, step=state.step, complete=state.complete,
            provisional=provisional, revision=state.revision, world_size=state.world_size,
            ranks_received=sorted(state.done), missing_ranks=state.missing_ranks, n_samples=len(state.ids),
            metrics=metrics, per_rank=per_rank,
            composite=composite({m: s["mean"] for m, s in metrics.items()}, dict(self.composite_weights)),
            coverage=_coverage(state), ts=now,
        )

    def findings(self, state: EvalState, report: EvalReport) -> RunUpdate:
        """Consistency and coverage findings of a non-provisional report."""
        findings, evaluated = [], [("eval_coverage", "duplicate_ids"), ("eval_coverage", "missing_ids")]
        owners = np.asarray(state.owners, dtype=np.int64)
        for name, summary in report.metrics.items():
            evaluated.append(("eval_nonfinite", name))
            if summary["n"] == 0 and summary.get("nonfinite", 0) > 0:
                findings.append(Finding(
                    "eval_nonfinite", name, None, math.nan, 1.0, "critical",
                    f"eval {state.eval_id} (step {state.step}): every value of {name} is NaN or infinite "
                    f"({summary['nonfinite']} of them): the model or the metric is broken",
                ))
        for name, column in state.values.items():
            values = np.asarray(column, dtype=np.float64)
            result = consistency({r: values[owners == r] for r in np.unique(owners).tolist()}, alpha=self.alpha)
            if result is None:
                continue
            evaluated.append(("eval_consistency", name))
            overall = report.metrics[name]["mean"]
            for rank in result.outliers:
                mean = report.per_rank[str(rank)][name]["mean"]
                p = result.rank_p[rank]
                findings.append(Finding(
                    "eval_consistency", name, rank, mean, 1.0 - p, "warning",
                    f"eval {state.eval_id} (step {state.step}): {name} on rank {rank} = {mean:.4g} vs "
                    f"{overall:.4g} overall; differs beyond sampling noise ({result.test}, Holm p = {p:.2g})",
                ))
            if result.ambiguous:
                findings.append(Finding(
                    "eval_consistency", name, None, result.p_value, 1.0 - result.p_value, "warning",
                    f"eval {state.eval_id} (step {state.step}): {name} differs between ranks "
                    f"({result.test} p = {result.p_value:.2g}); too few ranks to tell which",
                ))
        by_rank: dict[int, list[int]] = {}
        for sid, _, other in state.duplicates:
            by_rank.setdefault(other, []).append(sid)
        for rank, sids in sorted(by_rank.items()):
            findings.append(Finding(
                "eval_coverage", "duplicate_ids", rank, float(len(sids)), 1.0, "warning",
                f"eval {state.eval_id} (step {state.step}): rank {rank} sent {len(sids)} sample ids another "
                f"rank already sent (e.g. {sids[:5]}); they are counted once",
            ))
        cov = report.coverage
        if cov["n_missing"] and not state.stop_advised or report.missing_ranks:
            ranks = f"ranks {report.missing_ranks} did not finish" if report.missing_ranks else "all ranks finished"
            findings.append(Finding(
                "eval_coverage", "missing_ids", None, float(cov["n_missing"] or len(report.missing_ranks)), 1.0,
                "warning",
                f"eval {state.eval_id} (step {state.step}): {ranks}; {report.n_samples} samples received"
                + (f" of {cov['expected']}" if cov["expected"] is not None else ""),
            ))
        return RunUpdate(report, findings, evaluated)

    def _advise_stop(self, state: EvalState, now: float, out: EvalOutput) -> None:
        column = state.values.get(self.primary_metric)
        if self.stop_rule is None or column is None or state.stop_advised or state.complete:
            return
        if self.stop_rule.should_stop(column, state.dataset_size):
            state.stop_advised = True
            half = self.stop_rule.half_width(column, state.dataset_size)
            out.controls.append(Control(
                run=state.run, action="stop_eval", eval_id=state.eval_id, value=half, ts=now,
                reason=f"{self.primary_metric} 95% CI half-width {half:.4g} <= target {self.stop_rule.target:g} "
                       f"after {len(state.ids)} samples",
            ))


def _merge(state: EvalState, shard: EvalShard) -> tuple[int, int]:
    """Append the shard's new samples; record cross-rank duplicates. Returns (added, new duplicates)."""
    index, dup_seen = state.index(), state.dup_seen()
    columns = {name: np.asarray(v, dtype=np.float64) for name, v in shard.metrics.items()}
    for name in columns:
        if name not in state.values:
            state.values[name] = [math.nan] * len(state.ids)
    added = dups = 0
    for i, sid in enumerate(np.asarray(shard.sample_ids).tolist()):
        pos = index.get(sid)
        if pos is None:
            index[sid] = len(state.ids)
            state.ids.append(sid)
            state.owners.append(shard.rank)
            for name, column in state.values.items():
                column.append(float(columns[name][i]) if name in columns else math.nan)
            added += 1
        elif state.owners[pos] != shard.rank and (sid, shard.rank) not in dup_seen:
            dup_seen.add((sid, shard.rank))
            state.duplicates.append([sid, state.owners[pos], shard.rank])
            dups += 1
    return added, dups


def _coverage(state: EvalState) -> dict:
    missing: list[int] = []
    n_missing = 0
    if state.dataset_size is not None:
        have = np.zeros(state.dataset_size, dtype=bool)
        ids = np.asarray(state.ids, dtype=np.int64)
        have[ids[(ids >= 0) & (ids < state.dataset_size)]] = True
        absent = np.flatnonzero(~have)
        n_missing, missing = int(absent.size), absent[:MAX_IDS].tolist()
    return {
        "expected": state.dataset_size, "received": len(state.ids),
        "missing_ids": missing, "duplicate_ids": sorted({d[0] for d in state.duplicates})[:MAX_IDS],
        "n_missing": n_missing, "n_duplicate": len({d[0] for d in state.duplicates}),
        "stopped_early": state.stop_advised,
    }


def _close(state: EvalState) -> None:
    """Drop the samples of an old, finished evaluation; keep enough to ignore its stragglers."""
    state.closed = True
    state.ids, state.owners, state.values, state.duplicates = [], [], {}, []
    state._index = state._dup_seen = None
