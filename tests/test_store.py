"""The report store on SQLite and on a real PostgreSQL server: idempotent writes, resumable offsets,
migrations, and the queries behind ``rankwatch report`` / ``runs`` and the HTTP API."""

from __future__ import annotations

import json
import math

import pytest
from conftest import missing
from pgserver import PostgresServer, find_bin_dir

from rankwatch.contract import Alert, EvalReport, Rollup
from rankwatch.errors import RankwatchError
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_query import Filters, Queries, parse_since, parse_steps
from rankwatch.sinks.store_schema import MIGRATIONS, migrate

PG_BIN = find_bin_dir()


@pytest.fixture(scope="module")
def postgres():
    if PG_BIN is None:
        missing("PostgreSQL's server binaries are not installed (make test installs them)")
    with PostgresServer(PG_BIN) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = ReportStore(str(tmp_path / "store.db"))
        yield s
        s.close()
        return
    server = request.getfixturevalue("postgres")
    import psycopg

    name = f"t{abs(hash(request.node.name)) % 10**9}"
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
    s = ReportStore(server.url.rsplit("/", 1)[0] + "/" + name)
    yield s
    s.close()


def rollup(run="r1", rank=0, metric="loss", start=0, width=10, mean=1.0, count=10, ts=100.0, **kw) -> Rollup:
    fields = dict(run=run, rank=rank, metric=metric, start_step=start, end_step=start + width, count=count,
                  nonfinite=0, mean=mean, std=0.5, min=mean - 1, max=mean + 1, last=mean, ts=ts)
    return Rollup(**{**fields, **kw})


def report(run="r1", eval_id="e1", step=100, revision=1, mean=0.9) -> EvalReport:
    return EvalReport(run=run, eval_id=eval_id, step=step, complete=True, provisional=False, revision=revision,
                      world_size=4, ranks_received=[0, 1, 2, 3], missing_ranks=[], n_samples=400,
                      metrics={"correct": {"n": 400, "mean": mean, "std": 0.3, "ci_low": mean - 0.03,
                                           "ci_high": mean + 0.03, "method": "wilson"},
                               "loss": {"n": 0, "mean": math.nan, "std": math.nan, "ci_low": math.nan,
                                        "ci_high": math.nan, "method": "t"}},
                      per_rank={"0": {"correct": {"n": 100, "mean": mean}}}, composite=mean, coverage={}, ts=200.0)


def alert(run="r1", status="firing", step=30, ranks=(2,), ts=150.0) -> Alert:
    return Alert(key=f"{run}/nonfinite/loss", run=run, status=status, severity="critical", detector="nonfinite",
                 metric="loss", rank=ranks[0] if len(ranks) == 1 else None, ranks=ranks, step=step, value=math.nan,
                 message="loss is NaN", ts=ts, score=1.0, incident=30)


def records(*events, topic="rankwatch.reports", partition=0, start=0):
    return [(topic, partition, start + i, e.to_bytes()) for i, e in enumerate(events)]


def dump(store: ReportStore) -> dict:
    q = Queries(store.db)
    return {"rollups": q.rollups("r1"), "reports": [r.to_dict() for r in q.eval_reports("r1")],
            "alerts": q.alerts("r1"), "runs": q.runs(), "offsets": store.offsets()}


def test_a_replayed_batch_changes_nothing(store):
    batch = records(rollup(), rollup(rank=1, mean=3.0), report(), rollup(start=10)) + \
        records(alert(), topic="rankwatch.alerts")
    store.write(batch)
    before = dump(store)
    per_rank = [r for r in before["rollups"] if r["rank"] is not None]
    assert len(per_rank) == 3 and len(before["reports"]) == 1 and len(before["alerts"]) == 1
    assert len(before["rollups"]) == 5  # and a row merged across ranks per window
    store.write(batch)
    store.write(batch[2:4])  # a partial replay, as after a crash between poll and commit
    assert dump(store) == before


def test_offsets_commit_with_the_rows(store):
    store.write(records(rollup(), rollup(start=10), partition=3, start=41))
    store.write(records(alert(), topic="rankwatch.alerts", partition=1, start=7))
    assert store.offsets() == {("rankwatch.reports", 3): 43, ("rankwatch.alerts", 1): 8}


def test_an_older_revision_never_replaces_a_newer_one(store):
    store.write(records(report(revision=3, mean=0.8)))
    store.write(records(report(revision=2, mean=0.1)))
    [r] = Queries(store.db).eval_reports("r1")
    assert (r.revision, r.metrics["correct"]["mean"]) == (3, 0.8)
    assert math.isnan(r.metrics["loss"]["mean"])  # non-finite values survive the round trip
    store.write(records(report(revision=4, mean=0.85)))
    assert Queries(store.db).eval_reports("r1")[0].revision == 4


def test_undecodable_messages_are_skipped_and_their_offsets_kept(store):
    result = store.write([("rankwatch.reports", 0, 0, b"not json"), *records(rollup(), start=1)])
    assert (result.skipped, result.rollups) == (1, 1)
    assert store.offsets() == {("rankwatch.reports", 0): 2}


def test_filters(store):
    store.write(records(
        rollup(start=0), rollup(start=10), rollup(start=20, ts=500.0), rollup(rank=1, start=0),
        rollup(metric="grad_norm", start=0), report(step=10, eval_id="e10"), report(step=20, eval_id="e20"),
    ) + records(alert(step=15), alert(status="resolved", step=25, ts=600.0), topic="rankwatch.alerts"))
    q = Queries(store.db)
    assert [r["start_step"] for r in q.rollups("r1", Filters(metric="loss", rank=0))] == [0, 10, 20]
    assert [r["start_step"] for r in q.rollups("r1", Filters(metric="loss", rank=0, steps=(12, 20)))] == [10, 20]
    assert [r["rank"] for r in q.rollups("r1", Filters(metric="loss", steps=(None, 5)))] == [None, 0, 1]
    assert [(r["rank"], r["start_step"]) for r in q.rollups("r1", Filters(since=400.0))] == [(None, 20), (0, 20)]
    assert [r.eval_id for r in q.eval_reports("r1", Filters(steps=(15, None)))] == ["e20"]
    assert list(q.eval_reports("r1", Filters(metric="correct"))[0].metrics) == ["correct"]
    assert [a["status"] for a in q.alerts("r1", Filters(steps=(20, 30)))] == ["resolved"]
    assert [a["status"] for a in q.alerts("r1", Filters(rank=2))] == ["firing", "resolved"]
    assert q.alerts("r1", Filters(rank=3)) == []
    [run] = q.runs()
    assert (run["run"], run["first_step"], run["last_step"], run["alerts"], run["firing"]) == ("r1", 0, 29, 1, 0)
    assert {m["metric"] for m in q.metrics("r1")} == {"loss", "grad_norm"}


def test_prune_deletes_every_row_of_the_runs_last_active_before_the_cutoff(store):
    # "old" was last active at ts 300 (its alert), "new" at 5000: a cutoff between them prunes only "old".
    old = [rollup(run="old", ts=100.0), rollup(run="old", rank=1, start=10, ts=200.0), report(run="old")]
    new = [rollup(run="new", ts=100.0), rollup(run="new", start=10, ts=5000.0), report(run="new")]
    store.write(records(*old, *new) + records(alert(run="old", ts=300.0), alert(run="new"), topic="rankwatch.alerts"))
    q = Queries(store.db)
    kept = {"rollups": q.rollups("new"), "reports": q.eval_reports("new"), "alerts": q.alerts("new")}
    dry = store.prune(300.5, dry_run=True)
    assert [run for run, _ in dry.runs] == ["old"] and dry.runs[0][1] == 300.0
    assert dry.rows == {"rollups": 4, "eval_reports": 1, "alerts": 1, "runs": 1}  # 2 windows, 2 run-wide rows
    assert len(q.rollups("old")) == 4  # a dry run deletes nothing

    assert store.prune(300.0).runs == []  # not before the cutoff: last active exactly at it
    result = store.prune(300.5)
    assert (result.runs, result.rows) == (dry.runs, dry.rows)
    assert (q.rollups("old"), q.eval_reports("old"), q.alerts("old")) == ([], [], [])
    assert [r["run"] for r in q.runs()] == ["new"]
    assert {"rollups": q.rollups("new"), "reports": q.eval_reports("new"), "alerts": q.alerts("new")} == kept
    assert store.prune(300.5).rows == {"rollups": 0, "eval_reports": 0, "alerts": 0, "runs": 0}
    assert store.offsets() == {("rankwatch.reports", 0): 6, ("rankwatch.alerts", 0): 2}  # not read back


def test_store_prune_command(tmp_path, capsys):
    import time

    from rankwatch.cli import main

    path = str(tmp_path / "store.db")
    s = ReportStore(path)
    now = time.time()
    s.write(records(rollup(run="month-old", ts=now - 31 * 86400), rollup(run="today", ts=now - 3600)))
    s.close()
    assert main(["store", "prune", "--older-than", "30", "--dry-run", "--store", path]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("month-old  last active ") and "would prune 1 run(s)" in err and "2 rollups" in err
    assert main(["store", "--store", path, "prune", "--older-than", "30"]) == 0
    assert "pruned 1 run(s) last active more than 30 day(s) ago: 2 rollups, 0 eval reports, 0 alerts" in \
        capsys.readouterr().err
    assert main(["runs", "--json", "--store", path]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)] == ["today"]
    assert main(["store", "prune", "--older-than", "-1", "--store", path]) == 2
    assert main(["store", "prune", "--older-than", "1", "--store", str(tmp_path / "none.db")]) == 2
    assert not (tmp_path / "none.db").exists()


def test_migrations_run_once_and_a_newer_schema_is_refused(store):
    assert migrate(store.db) == len(MIGRATIONS)  # again: nothing to do
    with store.db.transaction() as cur:
        cur.execute("INSERT INTO schema_version (version) VALUES (99)")
    with pytest.raises(RankwatchError, match="newer"):
        migrate(store.db)


def test_sqlite_store_is_in_wal_mode(tmp_path):
    s = ReportStore(str(tmp_path / "x" / "store.db"))
    assert s.db.query("PRAGMA journal_mode") == [("wal",)]
    s.close()


def test_parsers():
    assert parse_steps("5:7") == (5, 7)
    with pytest.raises(ValueError):
        parse_steps("5")
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("2026-01-01T00:00:00+00:00") == 1767225600.0


def _window_rollup(run, rank, values, start=0, width=100, world=2) -> Rollup:
    import numpy as np

    from rankwatch.stream_processors.windows import roll

    steps = np.arange(start, start + len(values))
    window, _ = roll(None, steps, np.asarray(values, dtype=float), width)
    return window.to_rollup(run=run, rank=rank, metric="loss", width=width, now=123.0, world_size=world)


def test_ranks_merge_into_a_run_wide_row_with_quantiles(store):
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.lognormal(size=60), rng.lognormal(size=40) * 3
    b[5] = math.nan
    store.write(records(_window_rollup("r1", 0, a), _window_rollup("r1", 1, b)))
    q = Queries(store.db)
    [merged] = q.rollups("r1", Filters(rank="all"))
    both = np.concatenate([a, b[np.isfinite(b)]])
    assert (merged["rank"], merged["ranks"], merged["count"], merged["nonfinite"]) == (None, 2, 99, 1)
    assert merged["mean"] == pytest.approx(both.mean()) and merged["std"] == pytest.approx(both.std(ddof=1))
    assert (merged["min"], merged["max"]) == (pytest.approx(both.min()), pytest.approx(both.max()))
    assert (merged["first_step"], merged["last_step"], merged["world_size"]) == (0, 59, 2)
    for name, p in (("p50", 50), ("p95", 95), ("p99", 99)):  # at most 100 points per rank: nearly exact
        rank_error = abs(np.mean(both <= merged[name]) - p / 100)
        assert rank_error <= 0.02, (name, merged[name], np.percentile(both, p))
    [rank0] = q.rollups("r1", Filters(rank=0))
    assert rank0["p50"] == pytest.approx(np.median(a), rel=0.05)
    before = dump(store)
    store.write(records(_window_rollup("r1", 1, b), start=1))  # a replay of one rank, from where it was
    assert dump(store) == before


def test_a_complete_window_supersedes_the_partial_one_a_closing_rank_sent(store):
    store.write(records(_window_rollup("r1", 0, [1.0, 2.0]), _window_rollup("r1", 1, [5.0])))
    store.write(records(_window_rollup("r1", 0, [1.0, 2.0, 3.0, 4.0])))
    rows = {r["rank"]: r for r in Queries(store.db).rollups("r1")}
    assert (rows[0]["count"], rows[None]["count"], rows[None]["max"]) == (4, 5, 5.0)
    assert rows[None]["last"] == 4.0  # rank 0 got furthest (step 3)


def test_a_write_without_merging_leaves_the_run_wide_row_to_a_later_merge_even_across_a_restart(store, tmp_path,
                                                                                               request):
    # The sink merges run-wide rows at most every 2 s: a window of 1,024 ranks, merged again for
    # every poll that brought some of its ranks, cost about 20 CPU s (issue 16).
    store.write(records(_window_rollup("r1", 0, [1.0, 2.0]), _window_rollup("r1", 1, [5.0])), merge=False)
    assert [r["rank"] for r in Queries(store.db).rollups("r1")] == [0, 1]
    if store.db.dialect.name == "sqlite":  # what a crash leaves is merged by the next process
        store.close()
        store = ReportStore(str(tmp_path / "store.db"))
        request.addfinalizer(store.close)
    assert store.merge() == 1
    rows = {r["rank"]: r for r in Queries(store.db).rollups("r1")}
    assert (rows[None]["ranks"], rows[None]["count"], rows[None]["max"]) == (2, 3, 5.0)
    assert store.merge() == 0
    merged_at_once = ReportStore(str(tmp_path / "other.db"))
    merged_at_once.write(records(_window_rollup("r1", 0, [1.0, 2.0]), _window_rollup("r1", 1, [5.0])))
    assert Queries(merged_at_once.db).rollups("r1") == Queries(store.db).rollups("r1")
    merged_at_once.close()


@pytest.mark.broker
def test_a_sink_for_a_broker_that_started_empty_ignores_positions_saved_from_another(tmp_path):
    # A new embedded broker starts its partitions at 0 again. A position saved from the last one that is
    # still inside the new partition would skip what came first; from_beginning (what a Stack's fresh
    # Tansu broker gets) stores it, and the rows already stored are not duplicated.
    from kafka import KafkaProducer

    from rankwatch.admin import ensure_topics
    from rankwatch.broker import EmbeddedBroker, free_port
    from rankwatch.sinks.store_sink import StoreSink

    with EmbeddedBroker(port=free_port()) as broker:
        ensure_topics(broker.bootstrap, 8)
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        for start in (0, 10):  # one key, so one partition: offsets 0 and 1
            producer.send("rankwatch.reports", rollup(run="new", start=start).to_bytes(), key=b"new/0")
        producer.flush()
        producer.close()
        for from_beginning, expected in ((False, [10]), (True, [0, 10])):
            store = ReportStore(str(tmp_path / f"{from_beginning}.db"))
            store.write([("rankwatch.reports", p, 0, rollup(run="old", start=p).to_bytes()) for p in range(8)])
            StoreSink(store, broker.bootstrap, from_beginning=from_beginning).run(follow=False, stop_after_s=30)
            rows = Queries(store.db).rollups("new", Filters(rank=0))
            assert [r["start_step"] for r in rows] == expected, from_beginning
            assert len(Queries(store.db).rollups("old", Filters(rank=0))) == 8
            store.close()
