"""The report store's schema: an ordered list of migrations and the ``schema_version`` table.

Migration ``i`` (1-based) takes the schema from version ``i - 1`` to ``i``. Each runs in the same
transaction as its version bump, so a crash leaves the old or the new schema, never half. A store
written by a newer rankwatch (a higher version than we know) is refused rather than misread.

The SQL is the subset that SQLite and PostgreSQL share; ``Dialect`` holds the few differences.
Floats are DOUBLE PRECISION (REAL affinity in SQLite). SQLite stores NaN as NULL, so readers map a
NULL float back to NaN.

``rollups.rank`` is -1 for the row merged across ranks (``ranks`` says how many it merged): one
table, one key, one query path for per-rank and run-wide rows (NULL cannot be part of a key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rankwatch.errors import RankwatchError

ALL_RANKS = -1


@dataclass(frozen=True)
class Dialect:
    name: str
    placeholder: str  # the driver's parameter marker
    least: str  # the two-argument minimum / maximum functions
    greatest: str

    def sql(self, statement: str) -> str:
        """Statements are written with ``?``; PostgreSQL's driver wants ``%s``."""
        return statement if self.placeholder == "?" else statement.replace("?", self.placeholder)


SQLITE = Dialect("sqlite", "?", "MIN", "MAX")
POSTGRES = Dialect("postgresql", "%s", "LEAST", "GREATEST")


def _v1(cur, dialect: Dialect) -> None:
    for statement in (
        """CREATE TABLE rollups (
            run TEXT NOT NULL, rank INTEGER NOT NULL, metric TEXT NOT NULL,
            start_step BIGINT NOT NULL, end_step BIGINT NOT NULL,
            first_step BIGINT, last_step BIGINT, world_size INTEGER, ranks INTEGER NOT NULL,
            count BIGINT NOT NULL, nonfinite BIGINT NOT NULL,
            mean DOUBLE PRECISION, std DOUBLE PRECISION, min DOUBLE PRECISION, max DOUBLE PRECISION,
            last DOUBLE PRECISION, p50 DOUBLE PRECISION, p95 DOUBLE PRECISION, p99 DOUBLE PRECISION,
            sketch TEXT, ts DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run, metric, rank, start_step))""",
        # The usual query: one run, steps in order, optionally one metric or rank.
        "CREATE INDEX rollups_by_run_step ON rollups (run, start_step)",
        """CREATE TABLE eval_reports (
            run TEXT NOT NULL, eval_id TEXT NOT NULL, step BIGINT NOT NULL, revision BIGINT NOT NULL,
            complete INTEGER NOT NULL, provisional INTEGER NOT NULL, world_size INTEGER NOT NULL,
            body TEXT NOT NULL, ts DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run, eval_id))""",
        # (key, status, incident, ranks) identifies one transition (docs/contract.md).
        """CREATE TABLE alerts (
            key TEXT NOT NULL, status TEXT NOT NULL, incident BIGINT NOT NULL, ranks TEXT NOT NULL,
            run TEXT NOT NULL, severity TEXT NOT NULL, detector TEXT NOT NULL, metric TEXT NOT NULL,
            rank INTEGER, step BIGINT NOT NULL, value DOUBLE PRECISION, score DOUBLE PRECISION,
            message TEXT NOT NULL, ts DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (key, status, incident, ranks))""",
        "CREATE INDEX alerts_by_run ON alerts (run, ts)",
        # Kept up to date on every write (min/max only, so replays change nothing): `runs` stays
        # fast on a store of millions of rollups.
        """CREATE TABLE runs (
            run TEXT PRIMARY KEY, first_step BIGINT, last_step BIGINT, world_size INTEGER,
            first_ts DOUBLE PRECISION, last_ts DOUBLE PRECISION)""",
        # The sink's read position, written in the same transaction as the rows it covers.
        """CREATE TABLE offsets (
            topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset BIGINT NOT NULL,
            PRIMARY KEY (topic, partition))""",
    ):
        cur.execute(statement)


def _v2(cur, dialect: Dialect) -> None:
    # A run's run-wide rows (rank -1) and one rank's rows without naming the metric: `metrics`, `rank=all`.
    # (run, rank) first, then metric: the planner can then take it for `GROUP BY metric` too.
    cur.execute("CREATE INDEX rollups_by_run_rank ON rollups (run, rank, metric, start_step)")


def _v3(cur, dialect: Dialect) -> None:
    # Windows whose per-rank rows changed since their run-wide row was merged (``store_rollups``),
    # written in the same transaction as those rows, so a restart merges what a crash left.
    cur.execute("""CREATE TABLE pending_merges (
        run TEXT NOT NULL, metric TEXT NOT NULL, start_step BIGINT NOT NULL,
        PRIMARY KEY (run, metric, start_step))""")


MIGRATIONS: list[Callable] = [_v1, _v2, _v3]


def migrate(db) -> int:
    """Bring the schema of ``db`` (a ``store.Database``) to the newest version; return it.

    Safe on every start, and by several processes at once: each migration's transaction re-reads the
    version first, so a migration that another process already ran is skipped.
    """
    with db.transaction() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    for version in range(1, len(MIGRATIONS) + 1):
        with db.transaction(exclusive=True) as cur:
            current = _version(cur)
            if current > len(MIGRATIONS):
                raise RankwatchError(f"the report store has schema version {current}, newer than this rankwatch "
                                     f"knows ({len(MIGRATIONS)}): upgrade rankwatch")
            if current >= version:
                continue
            MIGRATIONS[version - 1](cur, db.dialect)
            cur.execute(db.dialect.sql("INSERT INTO schema_version (version) VALUES (?)"), (version,))
    return len(MIGRATIONS)


def _version(cur) -> int:
    cur.execute("SELECT MAX(version) FROM schema_version")
    return cur.fetchone()[0] or 0
