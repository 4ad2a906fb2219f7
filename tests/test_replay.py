"""``rankwatch record`` / ``replay`` on the real broker: a run recorded from the topics and sent back under a
new id goes through the running worker again and comes out the same: alerts, eval reports, rollups."""

from __future__ import annotations

import json

import pytest

from rankwatch.cli import main
from rankwatch.sim_runs import TrainingRun
from test_html_report import stored_run, wait_for

pytestmark = pytest.mark.broker


def test_record_then_replay_gives_the_same_outcome(stack, run_id, tmp_path, capsys):
    run = TrainingRun(run=run_id, ranks=2, steps=100, eval_every=25, nan_step=55, seed=3)
    q = stored_run(stack, run)
    assert wait_for(lambda: any(a["detector"] == "nonfinite" for a in q.alerts(run_id)), 30)
    original = run.records()
    path = tmp_path / "run.jsonl"
    assert main(["record", "--run", "r", str(tmp_path / "no" / "y.jsonl"), "--bootstrap", stack.bootstrap]) == 2
    assert capsys.readouterr().err.startswith(f"rankwatch: error: cannot write {tmp_path / 'no' / 'y.jsonl'}: ")
    assert main(["record", "--run", run_id, str(path), "--bootstrap", stack.bootstrap]) == 0
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)["counts"] == {"telemetry": sum(type(r).__name__ == "TelemetryBatch" for r in original),
                                            "eval_shard": sum(type(r).__name__ == "EvalShard" for r in original)}
    assert len(lines) == len(original) and all(json.loads(line)["value"]["run"] == run_id for line in lines)
    capsys.readouterr()

    new = f"{run_id}-again"
    assert main(["replay", str(path), "--run", new, "--bootstrap", stack.bootstrap]) == 0
    assert capsys.readouterr().out.strip() == new
    replayed = stored_run(stack, TrainingRun(run=new, ranks=2, steps=100, eval_every=25))  # waits for all of it
    assert wait_for(lambda: any(a["detector"] == "nonfinite" for a in q.alerts(new)), 30)

    def outcome(r):
        alerts = sorted((a["detector"], a["metric"], a["step"], a["status"], tuple(a["ranks"])) for a in q.alerts(r))
        reports = [(e.step, round(e.metrics["correct"]["mean"], 9)) for e in q.eval_reports(r) if e.complete]
        rollups = sorted((x["metric"], -1 if x["rank"] is None else x["rank"], x["start_step"], round(x["mean"], 9)) for x in q.rollups(r)
                         if x["mean"] == x["mean"])
        return alerts, reports, rollups

    assert outcome(new) == outcome(run_id) and replayed is not None
    nan_alert = next(a for a in q.alerts(new) if a["detector"] == "nonfinite" and a["status"] == "firing")
    assert (nan_alert["step"], nan_alert["ranks"], nan_alert["run"]) == (55, [0], new)


def test_replay_refuses_what_it_cannot_use(stack, tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"not": "a recording"}\n')
    assert main(["replay", str(bad), "--bootstrap", stack.bootstrap]) == 2
    assert "not a rankwatch recording" in capsys.readouterr().err
    bad.write_bytes(bytes(range(128, 256)))
    assert main(["replay", str(bad), "--bootstrap", stack.bootstrap]) == 2
    assert "not a rankwatch recording (not text)" in capsys.readouterr().err
    for missing in (tmp_path / "nowhere.jsonl", tmp_path):
        assert main(["replay", str(missing), "--bootstrap", stack.bootstrap]) == 2
        assert capsys.readouterr().err.startswith(f"rankwatch: error: cannot read {missing}: ")
    assert main(["record", "--run", "no-such-run", str(tmp_path / "y.jsonl"), "--bootstrap", stack.bootstrap]) == 2
    assert "no telemetry or eval shards" in capsys.readouterr().err
