"""Rollup rows of the report store: one per (run, metric, rank, window).

A rollup sent again for the same window (a replay, or the window's final rollup after the partial
one a closing rank sent) replaces the row: the newest emission of a window covers the most points.
"""

from __future__ import annotations

import math

from rankwatch.contract import Rollup
from rankwatch.sinks.store_schema import Dialect

COLUMNS = ("run", "rank", "metric", "start_step", "end_step", "first_step", "last_step", "world_size", "ranks",
           "count", "nonfinite", "mean", "std", "min", "max", "last", "p50", "p95", "p99", "sketch", "ts")
KEY = ("run", "metric", "rank", "start_step")


def upsert_sql() -> str:
    updates = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS if c not in KEY)
    return (f"INSERT INTO rollups ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
            f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {updates}")


def upsert(cur, dialect: Dialect, rollups: list[Rollup]) -> set[tuple[str, str, int]]:
    """Upsert the batch's rollups (the last of each window wins); return the windows touched."""
    latest = {(r.run, r.metric, r.rank, r.start_step): r for r in rollups}
    if latest:
        cur.executemany(dialect.sql(upsert_sql()), [row(r) for r in latest.values()])
    return {(run, metric, start) for run, metric, _, start in latest}


def row(r: Rollup) -> tuple:
    first, last = step_range(r)
    return (r.run, r.rank, r.metric, r.start_step, r.end_step, first, last, world_size(r), 1,
            r.count, r.nonfinite, _real(r.mean), _real(r.std), _real(r.min), _real(r.max), _real(r.last),
            None, None, None, None, r.ts)


def step_range(r: Rollup) -> tuple[int, int]:
    """The steps the window spans (the steps it saw, where the rollup says)."""
    return r.start_step, r.end_step - 1


def world_size(r: Rollup) -> int:
    return r.rank + 1  # a lower bound: rollups name their rank, not the world size


def _real(x: float) -> float | None:
    return None if math.isnan(x) else x  # what SQLite stores for NaN anyway: both databases read alike
