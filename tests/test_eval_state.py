"""EvalProcessor and RunTracker: merging, dedup, deadlines, amendments, advice and alert transitions,
with an injected clock and no broker."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rankwatch.contract import SCHEMA_VERSION, EvalReport, EvalShard, Finding, RunUpdate, SchemaError
from rankwatch.stream_processors.evaluation import (
    EvalProcessor,
    EvalState,
    EvalStateError,
    IntervalAdvisor,
    RunState,
    RunTracker,
    ShardRejected,
    StopRule,
)
from rankwatch.stream_processors.evaluation.state import EVAL_STATE_VERSION

WORLD, N = 4, 400
RNG = np.random.default_rng(0)
CORRECT = RNG.binomial(1, 0.8, N).astype(float)
LENGTH = RNG.gamma(2.0, 50.0, N)


def _shard(rank, chunk=0, *, ids=None, last=True, correct=CORRECT, eval_id="e1", step=100, world=WORLD, size=N):
    ids = np.arange(rank, size, world) if ids is None else np.asarray(ids, dtype=np.int64)
    return EvalShard(run="run-1", eval_id=eval_id, step=step, rank=rank, world_size=world, chunk=chunk, last=last,
                     sample_ids=ids, metrics={"correct": correct[ids], "length": LENGTH[ids]}, ts=0.0,
                     dataset_size=size)


def _proc(**kw) -> EvalProcessor:
    kw.setdefault("stop_rule", None)
    return EvalProcessor(deadline_s=10.0, provisional_interval_s=1.0, **kw)


def _frozen(state: EvalState) -> str:
    return json.dumps(state.to_dict(), sort_keys=True, allow_nan=False)


def test_four_ranks_merge_into_one_complete_report_with_the_direct_numbers():
    proc, state = _proc(), EvalState()
    outs = [proc.apply(state, _shard(r), now=100.0 + r * 0.1) for r in range(WORLD)]
    finals = [r for o in outs for r in o.reports if not r.provisional]
    assert len(finals) == 1
    report = finals[0]
    assert (report.complete, report.world_size, report.ranks_received, report.missing_ranks) == (
        True, 4, [0, 1, 2, 3], [])
    assert report.n_samples == N and report.revision == 2  # a provisional one went out first
    assert report.metrics["correct"]["mean"] == pytest.approx(CORRECT.mean())
    assert report.metrics["correct"]["method"] == "wilson" and report.metrics["length"]["method"] == "t"
    assert report.metrics["length"]["mean"] == pytest.approx(LENGTH.mean())
    assert report.metrics["length"]["std"] == pytest.approx(LENGTH.std(ddof=1))
    assert report.per_rank["2"]["correct"] == {"n": 100, "mean": pytest.approx(CORRECT[2::4].mean())}
    assert report.composite == pytest.approx(CORRECT.mean())  # default weights: correct=1
    assert report.coverage["n_missing"] == 0 and report.coverage["duplicate_ids"] == []
    [update] = outs[-1].updates
    assert update.report == report and update.findings == []


def test_replayed_chunks_change_nothing():
    proc, state = _proc(), EvalState()
    proc.apply(state, _shard(0, last=False, ids=np.arange(0, 200, 4)), now=1.0)
    before = _frozen(state)
    out = proc.apply(state, _shard(0, last=False, ids=np.arange(0, 200, 4)), now=5.0)
    assert (out.reports, out.updates, out.changed) == ([], [], False)
    assert _frozen(state) == before
    for r in range(WORLD):
        proc.apply(state, _shard(r), now=6.0)
    final = proc.report(state, 7.0, provisional=False)
    assert final.n_samples == N and final.metrics["correct"]["mean"] == pytest.approx(CORRECT.mean())
    assert proc.apply(state, _shard(3), now=8.0).reports == []  # a replay after completion


def test_the_same_sample_from_two_ranks_counts_once_and_is_reported():
    proc, state = _proc(), EvalState()
    for r in range(WORLD):
        proc.apply(state, _shard(r), now=1.0)
    out = proc.apply(state, _shard(2, chunk=1, ids=[0, 4, 8], last=False), now=2.0)  # rank 0's samples
    assert out.changed and state.duplicates == [[0, 0, 2], [4, 0, 2], [8, 0, 2]]
    report = proc.report(state, 3.0, provisional=False)
    assert report.n_samples == N
    assert report.coverage["duplicate_ids"] == [0, 4, 8] and report.coverage["n_duplicate"] == 3
    [finding] = proc.findings(state, report).findings
    assert (finding.detector, finding.metric, finding.rank, finding.value) == ("eval_coverage", "duplicate_ids", 2, 3)


def test_provisional_reports_are_throttled_and_revisions_grow():
    proc, state = _proc(), EvalState()
    chunks = [np.arange(0, N, 4)[i * 20:(i + 1) * 20] for i in range(5)]
    got = [proc.apply(state, _shard(0, i, ids=ids, last=False), now=10.0 + 0.4 * i) for i, ids in enumerate(chunks)]
    emitted = [o.reports[0] for o in got if o.reports]
    assert [r.revision for r in emitted] == [1, 2]  # at 10.0 and 11.2; 10.4, 10.8, 11.6 throttled
    assert all(r.provisional and not r.complete for r in emitted)
    assert state.dirty
    late = proc.tick(state, now=12.3)
    assert late.reports[0].revision == 3 and late.reports[0].n_samples == 100 and late.updates == []


def test_deadline_gives_an_incomplete_report_then_a_late_rank_amends_it():
    proc, state = _proc(), EvalState()
    for r in range(3):
        proc.apply(state, _shard(r), now=100.0)
    assert [r.provisional for r in proc.tick(state, now=101.0).reports] == [True]  # the throttled ones
    assert proc.tick(state, now=109.9).reports == []
    out = proc.tick(state, now=110.0)
    [report] = out.reports
    assert (report.complete, report.provisional, report.missing_ranks, report.ranks_received) == (
        False, False, [3], [0, 1, 2])
    [update] = out.updates
    [finding] = update.findings
    assert (finding.detector, finding.metric, finding.value) == ("eval_coverage", "missing_ids", 100)
    assert proc.tick(state, now=115.0).reports == []  # the deadline fires once

    late = proc.apply(state, _shard(3), now=130.0)
    [amended] = late.reports
    assert amended.complete and not amended.provisional and amended.revision > report.revision
    assert amended.metrics["correct"]["mean"] == pytest.approx(CORRECT.mean())
    assert late.updates[0].findings == []


def test_late_chunks_without_last_are_amended_on_a_tick():
    proc, state = _proc(), EvalState()
    for r in range(3):
        proc.apply(state, _shard(r), now=100.0)
    revision = proc.tick(state, now=110.0).reports[0].revision
    first = proc.apply(state, _shard(3, ids=[3, 7], last=False), now=120.0)
    assert first.reports[0].revision == revision + 1 and first.reports[0].n_samples == 302
    assert proc.apply(state, _shard(3, 1, ids=[11, 15], last=False), now=120.5).reports == []
    [amended] = proc.tick(state, now=121.0).reports
    assert amended.n_samples == 304 and not amended.provisional and not amended.complete


def test_a_shard_that_contradicts_its_evaluation_is_rejected():
    proc, state = _proc(), EvalState()
    proc.apply(state, _shard(0), now=1.0)
    with pytest.raises(ShardRejected, match="world_size 8"):
        proc.apply(state, _shard(1, world=8), now=2.0)
    with pytest.raises(ShardRejected, match="step 200"):
        proc.apply(state, _shard(1, step=200), now=2.0)


def test_stop_advice_goes_out_once_after_min_samples_and_excuses_the_missing_ids():
    proc, state = _proc(stop_rule=StopRule(target=0.05, min_samples=150)), EvalState()
    controls = []
    for i in range(4):  # every rank sends its first 50 samples
        controls += proc.apply(state, _shard(i, ids=np.arange(i, 200, 4), last=False), now=1.0 + i).controls
    [advice] = controls
    assert (advice.action, advice.eval_id, advice.run) == ("stop_eval", "e1", "run-1")
    assert advice.value <= 0.05 and "after 200 samples" in advice.reason
    outs = [proc.apply(state, _shard(r, 1, ids=[], last=True), now=5.0) for r in range(WORLD)]
    [final] = [r for o in outs for r in o.reports if not r.provisional]
    assert final.complete and final.n_samples == 200 and final.coverage["stopped_early"]
    assert final.coverage["n_missing"] == 200
    assert outs[-1].updates[0].findings == [] and not any(o.controls for o in outs)


def test_a_corrupted_rank_becomes_a_consistency_finding_naming_it():
    corrupted = CORRECT.copy()
    corrupted[1::4] = RNG.binomial(1, 0.3, N // 4)
    proc, state = _proc(), EvalState()
    outs = [proc.apply(state, _shard(r, correct=corrupted), now=1.0) for r in range(WORLD)]
    update = outs[-1].updates[0]
    [finding] = update.findings
    assert (finding.detector, finding.metric, finding.rank) == ("eval_consistency", "correct", 1)
    assert ("eval_consistency", "correct") in update.evaluated and ("eval_consistency", "length") in update.evaluated


def test_state_round_trips_through_json_mid_evaluation():
    proc = _proc()
    direct, restored = EvalState(), EvalState()
    for state in (direct, restored):
        proc.apply(state, _shard(0), now=1.0)
        proc.apply(state, _shard(1, ids=[5, 9, 0]), now=1.5)  # 0 is rank 0's: a duplicate
    restored = EvalState.from_dict(json.loads(json.dumps(restored.to_dict(), allow_nan=False)))
    assert _frozen(restored) == _frozen(direct)
    for state in (direct, restored):
        proc.apply(state, _shard(1, ids=[9, 13]), now=2.0)
    a, b = (proc.tick(s, now=20.0).reports[0] for s in (direct, restored))
    assert a.to_bytes() == b.to_bytes() and a.n_samples == 103 and a.coverage["duplicate_ids"] == [0]


def test_old_finished_evaluations_drop_their_samples_and_ignore_stragglers():
    proc, state = EvalProcessor(deadline_s=10.0, retention_s=100.0, stop_rule=None), EvalState()
    for r in range(WORLD):
        proc.apply(state, _shard(r), now=1.0)
    assert not proc.tick(state, now=50.0).changed
    assert proc.tick(state, now=101.0).changed and state.closed and state.ids == []
    assert proc.apply(state, _shard(0, chunk=5, ids=[399]), now=102.0) == proc.tick(state, now=500.0)
    assert state.ids == [] and json.dumps(state.to_dict())


# -- run tracker ----------------------------------------------------------------------------------


def _report(eval_id, step, correct, *, complete=True, revision=1, run="run-1") -> EvalReport:
    state = EvalState(run=run, eval_id=eval_id, step=step, world_size=1, done=[0] if complete else [],
                      ids=list(range(len(correct))), owners=[0] * len(correct),
                      values={"correct": list(map(float, correct))}, revision=revision)
    return _proc().report(state, 0.0, provisional=False)


def _accuracy(p, n=1000, seed=0):
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_regression_fires_once_stays_quiet_and_resolves_on_recovery():
    tracker, state = RunTracker(advisor=None), RunState()
    seen = []
    for i, p in enumerate([0.85, 0.86, 0.70, 0.71, 0.86]):
        seen.append(tracker.apply(state, RunUpdate(_report(f"e{i}", 100 * i, _accuracy(p, seed=i))), now=i).alerts)
    assert seen[0] == seen[1] == [] and seen[3] == []
    [fired] = seen[2]
    assert (fired.status, fired.detector, fired.metric, fired.rank, fired.step) == (
        "firing", "eval_regression", "correct", None, 200)
    assert fired.key == "run-1/eval_regression/correct" and "significant drop" in fired.message
    [resolved] = seen[4]
    assert (resolved.status, resolved.key, resolved.incident) == ("resolved", fired.key, 200)


def test_noise_between_evaluations_raises_no_regression():
    tracker, state = RunTracker(advisor=None), RunState()
    alerts = [a for i in range(30)
              for a in tracker.apply(state, RunUpdate(_report(f"e{i}", i, _accuracy(0.8, seed=100 + i))), now=i).alerts]
    assert alerts == []


def test_findings_fire_per_rank_and_resolve_when_the_check_runs_clean():
    tracker, state = RunTracker(advisor=None), RunState()
    bad = Finding("eval_consistency", "correct", 2, 0.4, 0.99, "warning", "rank 2 is off")
    checked = [("eval_consistency", "correct")]
    [fired] = tracker.apply(state, RunUpdate(_report("e1", 100, _accuracy(0.8)), [bad], checked), now=1).alerts
    assert (fired.key, fired.rank, fired.ranks, fired.message) == ("run-1/eval_consistency/correct/2", 2, (2,),
                                                                   "rank 2 is off")
    assert tracker.apply(state, RunUpdate(_report("e2", 200, _accuracy(0.8)), [bad], checked), now=2).alerts == []
    # An evaluation that did not run the check (e.g. too few ranks) resolves nothing.
    assert tracker.apply(state, RunUpdate(_report("e3", 300, _accuracy(0.8)), [], []), now=3).alerts == []
    # A late amendment of an older evaluation moves no condition either.
    assert tracker.apply(state, RunUpdate(_report("e1", 100, _accuracy(0.8), revision=2), [], checked), 4).alerts == []
    [resolved] = tracker.apply(state, RunUpdate(_report("e4", 400, _accuracy(0.8)), [], checked), now=5).alerts
    assert (resolved.status, resolved.key, resolved.incident) == ("resolved", fired.key, 100)


def test_incomplete_reports_do_not_feed_regression():
    tracker, state = RunTracker(advisor=None), RunState()
    tracker.apply(state, RunUpdate(_report("e1", 100, _accuracy(0.9))), now=1)
    out = tracker.apply(state, RunUpdate(_report("e2", 200, _accuracy(0.5), complete=False)), now=2)
    assert out.alerts == [] and [h["eval_id"] for h in state.history] == ["e1"]


def test_interval_advice_is_sent_when_it_changes():
    tracker = RunTracker(advisor=IntervalAdvisor(min_interval=10, max_interval=1000, window=4))
    state, controls = RunState(), []
    for i, p in enumerate([0.5, 0.8, 0.45, 0.85, 0.5]):  # swinging far beyond sampling noise
        controls += tracker.apply(state, RunUpdate(_report(f"e{i}", 100 * (i + 1), _accuracy(p, seed=i))), i).controls
    [advice] = controls  # the 5th evaluation suggests the same interval again: not re-sent
    assert (advice.action, advice.value, advice.eval_id) == ("set_eval_interval", 200.0, None)
    assert "swings" in advice.reason and state.interval == 200


def test_run_update_and_run_state_round_trip():
    update = RunUpdate(_report("e1", 100, _accuracy(0.8)),
                       [Finding("eval_coverage", "missing_ids", None, 3.0, 1.0, "warning", "3 missing")],
                       [("eval_coverage", "missing_ids")])
    assert RunUpdate.from_bytes(update.to_bytes()) == update
    tracker, state = RunTracker(advisor=None), RunState()
    tracker.apply(state, update, now=1.0)
    again = RunState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state and list(again.firing) == ["run-1/eval_coverage/missing_ids"]


def test_eval_states_of_another_layout_are_refused_never_misread():
    state = EvalState()
    _proc().apply(state, _shard(0), now=1.0)
    stored = json.loads(json.dumps(state.to_dict(), allow_nan=False))
    assert stored["version"] == EVAL_STATE_VERSION
    unversioned = {k: v for k, v in stored.items() if k != "version"}  # stored before versions: version 1
    assert _frozen(EvalState.from_dict(unversioned)) == _frozen(state)
    with pytest.raises(EvalStateError, match=rf"eval state has version 5; this worker reads version {EVAL_STATE_VERSION}"):
        EvalState.from_dict({**stored, "version": 5})
    with pytest.raises(EvalStateError, match="does not fit this worker: TypeError.*learned_later"):
        EvalState.from_dict({**stored, "learned_later": 1})  # a newer release's: not dropped silently
    with pytest.raises(EvalStateError, match="eval run state does not fit this worker: TypeError.*learned_later"):
        RunState.from_dict({**RunState().to_dict(), "learned_later": 1})


def test_report_reader_keeps_the_latest_revision_of_each_evaluation():
    from rankwatch.sinks.eval_reports import as_json, format_table, latest_reports

    values = [_report("e2", 200, _accuracy(0.8), revision=1).to_bytes(), b"\xff not json",
              b'{"schema": 1, "kind": "rollup", "run": "run-1"}', _report("e1", 100, _accuracy(0.7), revision=3).to_bytes(),
              _report("e2", 200, _accuracy(0.9), revision=2).to_bytes(),
              _report("e2", 200, _accuracy(0.5), revision=1).to_bytes(),  # a redelivery of an old revision
              _report("e9", 50, _accuracy(0.5), run="other").to_bytes()]
    reports = latest_reports(values, "run-1")
    assert [(r.eval_id, r.revision) for r in reports] == [("e1", 3), ("e2", 2)]
    assert as_json(reports[1])["metrics"]["correct"]["mean"] == pytest.approx(_accuracy(0.9).mean())
    assert "e2  step 200  complete  rev 2" in format_table(reports)


def test_run_update_is_a_contract_event_with_schema_and_kind():
    bad = Finding("eval_consistency", "correct", 2, float("nan"), 0.99, "warning", "rank 2 is off")
    update = RunUpdate(_report("e1", 100, _accuracy(0.8)), [bad], [("eval_consistency", "correct")])
    obj = json.loads(update.to_bytes())
    assert (obj["schema"], obj["kind"]) == (SCHEMA_VERSION, "run_update")
    back = RunUpdate.from_bytes(update.to_bytes())
    assert back.report == update.report and back.evaluated == update.evaluated and update.key == b"run-1"
    assert math.isnan(back.findings[0].value) and back.findings[0].message == "rank 2 is off"
    with pytest.raises(SchemaError, match="kind"):
        RunUpdate.from_bytes(update.to_bytes().replace(b'"run_update"', b'"rank_signal"'))
