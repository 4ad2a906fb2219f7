"""The report store on the real embedded broker: the Stack's store process fills it from the topics,
``rankwatch report`` / ``runs`` answer from it alone, and ``rankwatch store`` resumes where it stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.cli import main
from rankwatch.contract import Alert, Series, TelemetryBatch
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_query import Filters, Queries
from rankwatch.sinks.store_sink import StoreSink
from test_store import alert, report

pytestmark = pytest.mark.broker


def _wait(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    return check()


def _send(bootstrap: str, *events) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    for e in events:
        producer.send(e.TOPIC, e.to_bytes(), key=e.key if isinstance(e.key, bytes) else e.key.encode())
    producer.flush()
    producer.close()


def _telemetry(run: str, rank: int, steps: range, *, final: bool, seq: int) -> TelemetryBatch:
    s = np.arange(steps.start, steps.stop)
    return TelemetryBatch(run=run, rank=rank, world_size=2, producer=f"p{rank}", seq=seq, ts=time.time(),
                          final=final, series={"loss": Series(s, 1.0 + 0.01 * s + rank)})


def test_the_stack_stores_rollups_reports_and_alerts_and_report_answers_from_the_store(stack, bootstrap, run_id,
                                                                                        capsys):
    url = str(Path(stack.settings.data_dir) / "store.db")
    _send(bootstrap, *[_telemetry(run_id, rank, range(0, 25), final=True, seq=0) for rank in (0, 1)],
          report(run=run_id), alert(run=run_id))
    queries = Queries(ReportStore(url).db)
    # Run-wide rows follow their ranks' rows within the sink's merge interval: wait for both ranks in them.
    assert _wait(lambda: len(queries.eval_reports(run_id)) and len(queries.alerts(run_id))
                 and len([r for r in queries.rollups(run_id, Filters(rank="all")) if r["ranks"] == 2]) >= 3)

    assert main(["report", "--run", run_id, "--json", "--store", url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["eval_id"] for r in out["eval_reports"]] == ["e1"]
    assert out["eval_reports"][0]["metrics"]["loss"]["mean"] == "NaN"  # strict JSON, as on the wire
    per_rank = [r for r in out["rollups"] if r["rank"] is not None]
    assert {(r["rank"], r["start_step"]) for r in per_rank} >= {(0, 0), (0, 10), (1, 0), (1, 10)}
    first = next(r for r in per_rank if (r["rank"], r["start_step"]) == (1, 0))
    assert first["count"] == 10 and first["mean"] == pytest.approx(np.mean(2.0 + 0.01 * np.arange(10)))
    assert [a["status"] for a in out["alerts"]] == ["firing"]
    # The ranks closed (final) in the middle of window [20, 30): it came anyway, partial.
    partial = next(r for r in per_rank if (r["rank"], r["start_step"]) == (0, 20))
    assert (partial["count"], partial["first_step"], partial["last_step"]) == (5, 20, 24)
    run_wide = next(r for r in out["rollups"] if r["rank"] is None and r["start_step"] == 0)
    assert (run_wide["ranks"], run_wide["count"], run_wide["world_size"]) == (2, 20, 2)
    both = np.concatenate([1.0 + 0.01 * np.arange(10), 2.0 + 0.01 * np.arange(10)])
    assert abs(np.mean(both <= run_wide["p50"]) - 0.5) <= 0.05 and run_wide["p99"] <= both.max()

    assert main(["report", "--run", run_id, "--store", url, "--metric", "loss", "--steps", "0:200"]) == 0
    table = capsys.readouterr().out
    assert "eval reports" in table and "rollups" in table and "alerts" in table
    assert main(["report", "--run", run_id, "--store", url, "--rank", "1", "--steps", "0:9"]) == 0
    table = capsys.readouterr().out  # the evaluation (step 100) and the alert (step 30) are outside
    assert table.startswith("rollups") and len(table.strip().splitlines()) == 3
    assert main(["report", "--run", run_id, "--store", url, "--kind", "rollups", "--csv", "--rank", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("metric,rank,ranks,start_step") and all(",0," in line for line in lines[1:])

    assert main(["runs", "--json", "--store", url]) == 0
    [run] = [r for r in json.loads(capsys.readouterr().out) if r["run"] == run_id]
    assert (run["first_step"], run["world_size"], run["alerts"], run["firing"]) == (0, 4, 1, 1)


def test_store_resumes_from_its_committed_offsets(bootstrap, run_id, tmp_path):
    url = str(tmp_path / "store.db")
    _send(bootstrap, alert(run=run_id, step=1))
    first = StoreSink(ReportStore(url), bootstrap)
    first.run(follow=False, stop_after_s=60)
    assert first.written >= 1 and Queries(first.store.db).alerts(run_id)
    first.store.close()

    _send(bootstrap, alert(run=run_id, step=2, status="resolved"))
    second = StoreSink(ReportStore(url), bootstrap)
    second.run(follow=False, stop_after_s=60)
    assert 1 <= second.written < first.written  # only what arrived since, not the topics again
    assert [a["status"] for a in Queries(second.store.db).alerts(run_id)] == ["firing", "resolved"]


def test_report_without_a_store_says_how_to_get_one(tmp_path, capsys):
    assert main(["report", "--run", "r", "--store", str(tmp_path / "none.db")]) == 2
    assert "rankwatch up" in capsys.readouterr().err


def test_alert_key_type():  # the helpers above send alerts keyed by their condition
    assert isinstance(Alert.make_key("r", "d", "m"), str) and contract.ALERTS == "rankwatch.alerts"


def test_after_the_stack_stops_report_answers_with_what_the_workers_sent_last(tmp_path, capsys):
    from rankwatch.broker import free_port
    from rankwatch.settings import Settings
    from rankwatch.stack import Stack

    run = "stopped-broker"
    settings = Settings(data_dir=str(tmp_path), rollup_steps=10)
    with Stack(settings, embedded=True, port=free_port()) as stack:
        _send(stack.bootstrap, *[_telemetry(run, rank, range(0, 15), final=True, seq=0) for rank in (0, 1)],
              report(run=run))
        time.sleep(2.0)  # the workers have the telemetry; their rollups may still be on the way
        t = time.monotonic()
    assert time.monotonic() - t < 30  # the store drains, then stops: bounded
    # The broker is gone; the store answers.
    assert main(["report", "--run", run, "--json", "--store", str(tmp_path / "store.db")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["eval_id"] for r in out["eval_reports"]] == ["e1"]
    windows = {(r["rank"], r["start_step"]): r for r in out["rollups"]}
    assert {(0, 0), (0, 10), (1, 0), (1, 10), (None, 0), (None, 10)} <= set(windows)
    assert windows[(None, 10)]["count"] == 10 and isinstance(windows[(None, 10)]["p95"], float)
