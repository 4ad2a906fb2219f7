"""The report store: rollups, eval reports and alerts in SQLite (default) or PostgreSQL.

Every write is idempotent: rows have natural keys (a rollup's window, an evaluation, an alert
transition) and are upserted, an eval report only over an older revision. The sink's read position
is written in the same transaction as the rows it covers, so after a crash it resumes exactly where
the database is, and a replayed message changes nothing: each row is stored exactly once.

The URL is ``RANKWATCH_STORE_URL``: empty means ``<data dir>/store.db`` (SQLite, WAL, so readers
never block the writer); ``sqlite:///PATH`` or a plain path names another file; ``postgresql://…``
uses PostgreSQL through psycopg 3.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rankwatch import contract
from rankwatch.contract import Alert, EvalReport, Rollup
from rankwatch.errors import RankwatchError, SchemaError
from rankwatch.settings import Settings
from rankwatch.sinks import store_rollups
from rankwatch.sinks.store_schema import POSTGRES, SQLITE, Dialect, migrate

log = logging.getLogger(__name__)

STORE_FILE = "store.db"


def store_url(settings: Settings) -> str:
    """The store's URL from the settings: the one given, else the SQLite file in the data dir."""
    return settings.store_url or str(Path(settings.data_dir) / STORE_FILE)


class Database:
    """One connection and its dialect; ``transaction()`` yields a cursor and commits or rolls back."""

    def __init__(self, url: str):
        self.url = url
        if url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError:
                raise RankwatchError("a postgresql:// store needs psycopg: pip install 'rankwatch[postgres]'") from None
            self.dialect: Dialect = POSTGRES
            self.conn = psycopg.connect(url, autocommit=True)  # transactions are explicit, below
        else:
            path = Path(url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.dialect = SQLITE
            # isolation_level=None: no implicit transactions; ours are explicit (BEGIN … COMMIT), DDL included.
            self.conn = sqlite3.connect(path, isolation_level=None, timeout=30.0, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut loses the last commits, never consistency

    @contextmanager
    def transaction(self, *, exclusive: bool = False) -> Iterator:
        if self.dialect is POSTGRES:
            with self.conn.transaction(), self.conn.cursor() as cur:
                if exclusive:
                    cur.execute("LOCK TABLE schema_version IN EXCLUSIVE MODE")
                yield cur
            return
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE" if exclusive else "BEGIN")
        try:
            yield cur
        except BaseException:
            self.conn.rollback()
            raise
        else:
            self.conn.commit()
        finally:
            cur.close()

    def query(self, statement: str, params: Iterable = ()) -> list[tuple]:
        with self.transaction() as cur:
            cur.execute(self.dialect.sql(statement), tuple(params))
            return cur.fetchall()

    def close(self) -> None:
        self.conn.close()


@dataclass
class PruneResult:
    runs: list[tuple[str, float]]  # (run, last activity in Unix seconds), oldest first
    rows: dict[str, int]  # table -> rows deleted (or that would be, on a dry run)


@dataclass
class WriteResult:
    rollups: int = 0
    eval_reports: int = 0
    alerts: int = 0
    skipped: int = 0  # undecodable or of a kind the store does not keep
    touched: set = field(default_factory=set)  # (run, metric, start_step) windows written


class ReportStore:
    """``write(records)`` stores a batch of topic records; ``offsets()`` says where to resume."""

    def __init__(self, url: str):
        self.db = Database(url)
        migrate(self.db)

    @classmethod
    def open(cls, settings: Settings) -> ReportStore:
        return cls(store_url(settings))

    def close(self) -> None:
        self.db.close()

    def offsets(self) -> dict[tuple[str, int], int]:
        rows = self.db.query("SELECT topic, partition, next_offset FROM offsets")
        return {(topic, partition): offset for topic, partition, offset in rows}

    def write(self, records: Iterable[tuple[str, int, int, bytes]], *, merge: bool = True) -> WriteResult:
        """Store ``(topic, partition, offset, value)`` records and the offsets after them, atomically;
        with ``merge``, also the run-wide row of every window waiting for one (see ``merge``)."""
        result, rollups, reports, alerts = WriteResult(), [], {}, {}
        positions: dict[tuple[str, int], int] = {}
        for topic, partition, offset, value in records:
            positions[(topic, partition)] = max(positions.get((topic, partition), 0), offset + 1)
            try:
                obj = contract.decode_any(value)
                kind = obj.get("kind")
                if kind == Rollup.KIND:
                    rollups.append(Rollup.from_dict(obj))
                elif kind == EvalReport.KIND:
                    r = EvalReport.from_bytes(value)
                    known = reports.get((r.run, r.eval_id))
                    if known is None or r.revision > known.revision:
                        reports[(r.run, r.eval_id)] = r
                elif kind == Alert.KIND:
                    a = Alert.from_dict(obj)
                    alerts[(a.key, a.status, a.incident, tuple(a.ranks))] = a
                else:
                    result.skipped += 1
            except SchemaError as exc:
                log.warning("store: skipping an undecodable message at %s %d@%d: %s", topic, partition, offset, exc)
                result.skipped += 1
        sql = self.db.dialect.sql
        with self.db.transaction() as cur:
            result.touched = store_rollups.upsert(cur, self.db.dialect, rollups)
            for r in reports.values():
                cur.execute(sql(UPSERT_REPORT), _report_row(r))
            if alerts:
                cur.executemany(sql(INSERT_ALERT), [_alert_row(a) for a in alerts.values()])
            for row in _run_rows(rollups, reports.values(), alerts.values()):
                cur.execute(sql(_upsert_run(self.db.dialect)), row)
            if positions:
                cur.executemany(sql(UPSERT_OFFSET), [(t, p, o) for (t, p), o in positions.items()])
            if merge:
                store_rollups.merge_pending(cur, self.db.dialect)
        result.rollups, result.eval_reports, result.alerts = len(rollups), len(reports), len(alerts)
        return result

    def merge(self) -> int:
        """The run-wide rows of the windows whose per-rank rows changed since they were merged."""
        with self.db.transaction() as cur:
            return store_rollups.merge_pending(cur, self.db.dialect)


    def prune(self, before_ts: float, *, dry_run: bool = False) -> PruneResult:
        """Delete the rollups, eval reports and alerts of every run whose last activity (the newest ``ts`` of
        any of its rows) is before ``before_ts``, and the run itself; one transaction. The sink's positions
        stay, so what was pruned is not read back from the topics. On PostgreSQL the runs' rows are locked
        first: a write to one of them waits, and lands after the prune, as a run that starts over."""
        sql, lock = self.db.dialect.sql, " FOR UPDATE" if self.db.dialect is POSTGRES else ""
        rows: dict[str, int] = {}
        with self.db.transaction(exclusive=self.db.dialect is SQLITE) as cur:  # SQLite: take the write lock now
            cur.execute(sql(f"SELECT run, last_ts FROM runs WHERE last_ts < ? ORDER BY last_ts, run{lock}"),
                        (before_ts,))
            runs = [(run, last_ts) for run, last_ts in cur.fetchall()]
            names = [run for run, _ in runs]
            for table in (*PRUNED_TABLES, "runs"):
                rows[table] = 0
                for i in range(0, len(names), 500):  # SQLite takes at most 32766 parameters
                    chunk = names[i:i + 500]
                    where = f"run IN ({', '.join('?' * len(chunk))})"
                    if dry_run:
                        cur.execute(sql(f"SELECT COUNT(*) FROM {table} WHERE {where}"), chunk)
                        rows[table] += cur.fetchone()[0]
                    else:
                        cur.execute(sql(f"DELETE FROM {table} WHERE {where}"), chunk)
                        rows[table] += cur.rowcount
        return PruneResult(runs=runs, rows=rows)


PRUNED_TABLES = ("rollups", "eval_reports", "alerts")

UPSERT_REPORT = """
INSERT INTO eval_reports (run, eval_id, step, revision, complete, provisional, world_size, body, ts)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (run, eval_id) DO UPDATE SET step = excluded.step, revision = excluded.revision,
    complete = excluded.complete, provisional = excluded.provisional, world_size = excluded.world_size,
    body = excluded.body, ts = excluded.ts
WHERE excluded.revision > eval_reports.revision"""

INSERT_ALERT = """
INSERT INTO alerts (key, status, incident, ranks, run, severity, detector, metric, rank, step, value, score,
                    message, ts)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key, status, incident, ranks) DO NOTHING"""

UPSERT_OFFSET = """
INSERT INTO offsets (topic, partition, next_offset) VALUES (?, ?, ?)
ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset"""


def _upsert_run(d: Dialect) -> str:
    # Only minima and maxima: a replay, in any order, leaves the row as it was.
    def lo(col):
        return f"{d.least}(COALESCE(runs.{col}, excluded.{col}), COALESCE(excluded.{col}, runs.{col}))"

    def hi(col):
        return f"{d.greatest}(COALESCE(runs.{col}, excluded.{col}), COALESCE(excluded.{col}, runs.{col}))"

    return f"""
INSERT INTO runs (run, first_step, last_step, world_size, first_ts, last_ts) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (run) DO UPDATE SET first_step = {lo('first_step')}, last_step = {hi('last_step')},
    world_size = {hi('world_size')}, first_ts = {lo('first_ts')}, last_ts = {hi('last_ts')}"""


def _report_row(r: EvalReport) -> tuple:
    body = json.dumps(r.to_dict(), allow_nan=False, separators=(",", ":"))
    return (r.run, r.eval_id, r.step, r.revision, int(r.complete), int(r.provisional), r.world_size, body, r.ts)


def _alert_row(a: Alert) -> tuple:
    return (a.key, a.status, a.incident, json.dumps(list(a.ranks)), a.run, a.severity, a.detector, a.metric, a.rank,
            a.step, _real(a.value), _real(a.score), a.message, a.ts)


def _real(x: float) -> float | None:
    return None if math.isnan(x) else x  # as SQLite would store it anyway, so both databases read alike


def _run_rows(rollups, reports, alerts) -> list[tuple]:
    """One (run, first_step, last_step, world_size, first_ts, last_ts) per run in the batch."""
    runs: dict[str, list] = {}

    def see(run, lo, hi, world, ts):
        row = runs.setdefault(run, [lo, hi, world, ts, ts])
        row[0], row[1] = min(row[0], lo), max(row[1], hi)
        row[2] = max(row[2], world) if world is not None and row[2] is not None else (world or row[2])
        row[3], row[4] = min(row[3], ts), max(row[4], ts)

    for r in rollups:
        first, last = store_rollups.step_range(r)
        see(r.run, first, last, store_rollups.world_size(r), r.ts)
    for r in reports:
        see(r.run, r.step, r.step, r.world_size, r.ts)
    for a in alerts:
        see(a.run, a.step, a.step, None, a.ts)
    return [(run, *row) for run, row in runs.items()]
