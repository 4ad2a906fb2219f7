"""Rollup rows of the report store: one per (run, metric, rank, window), and one per (run, metric, window)
merged across ranks (``rank`` = -1).

A rollup sent again for the same window (a replay, or the window's final rollup after the partial
one a closing rank sent) replaces the row: the newest emission of a window covers the most points.
The run-wide row is recomputed from the per-rank rows of its window (``merge_pending``): a function
of what is stored, so replays leave it as it was. A window whose rows changed is noted in
``pending_merges`` in the same transaction as the rows, and merged when the writer says: merged on
every write, a window of 1,024 ranks closing at once was merged again for each poll that brought
some of its ranks (17 polls of 2,000 rollups at 32 metrics), about 20 CPU seconds every window. Every rank's
window has the same step bounds, so the rows of one window line up; their sketches merge into the
run-wide p50/p95/p99.
"""

from __future__ import annotations

import json
import math

from rankwatch.contract import Rollup
from rankwatch.sketch import Sketch
from rankwatch.sinks.store_schema import ALL_RANKS, Dialect

COLUMNS = ("run", "rank", "metric", "start_step", "end_step", "first_step", "last_step", "world_size", "ranks",
           "count", "nonfinite", "mean", "std", "min", "max", "last", "p50", "p95", "p99", "sketch", "ts")
KEY = ("run", "metric", "rank", "start_step")


def upsert_sql() -> str:
    updates = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS if c not in KEY)
    return (f"INSERT INTO rollups ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
            f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {updates}")


def upsert(cur, dialect: Dialect, rollups: list[Rollup]) -> set[tuple[str, str, int]]:
    """Upsert the batch's rollups (the last of each window wins) and note their windows for
    ``merge_pending``; return the windows touched."""
    latest = {(r.run, r.metric, r.rank, r.start_step): r for r in rollups}
    if not latest:
        return set()
    cur.executemany(dialect.sql(upsert_sql()), [row(r) for r in latest.values()])
    touched = {(run, metric, start) for run, metric, _, start in latest}
    cur.executemany(dialect.sql("INSERT INTO pending_merges (run, metric, start_step) VALUES (?, ?, ?) "
                                "ON CONFLICT (run, metric, start_step) DO NOTHING"), sorted(touched))
    return touched


def merge_pending(cur, dialect: Dialect) -> int:
    """Recompute the run-wide row of every window noted by ``upsert``; return how many."""
    cur.execute("SELECT run, metric, start_step FROM pending_merges ORDER BY run, metric, start_step")
    pending = cur.fetchall()
    if not pending:
        return 0
    merged = [m for key in pending if (m := _merge_ranks(cur, dialect, *key)) is not None]
    if merged:
        cur.executemany(dialect.sql(upsert_sql()), merged)
    cur.executemany(dialect.sql("DELETE FROM pending_merges WHERE run = ? AND metric = ? AND start_step = ?"),
                    pending)
    return len(pending)


def row(r: Rollup) -> tuple:
    first, last = step_range(r)
    sketch = json.dumps(r.sketch, separators=(",", ":")) if r.sketch else None
    return (r.run, r.rank, r.metric, r.start_step, r.end_step, first, last, world_size(r), 1,
            r.count, r.nonfinite, _real(r.mean), _real(r.std), _real(r.min), _real(r.max), _real(r.last),
            _real(r.p50), _real(r.p95), _real(r.p99), sketch, r.ts)


def _merge_ranks(cur, dialect: Dialect, run: str, metric: str, start: int) -> tuple | None:
    """The run-wide row of one window, from its per-rank rows (Chan et al.'s merge of the moments)."""
    cur.execute(dialect.sql(
        "SELECT rank, end_step, first_step, last_step, world_size, count, nonfinite, mean, std, min, max, last, "
        "sketch, ts FROM rollups WHERE run = ? AND metric = ? AND start_step = ? AND rank >= 0 ORDER BY rank"),
        (run, metric, start))
    rows = cur.fetchall()
    if not rows:
        return None
    n, mean, m2, nonfinite, sketch = 0, 0.0, 0.0, 0, Sketch()
    for _, _, _, _, _, count, bad, r_mean, r_std, *_ in rows:
        nonfinite += bad
        if not count:
            continue
        r_m2 = (r_std or 0.0) ** 2 * (count - 1)
        total = n + count
        delta = r_mean - mean
        mean += delta * count / total
        m2 += r_m2 + delta * delta * n * count / total
        n = total
    for row_ in rows:
        if row_[12]:
            sketch.merge(Sketch.from_wire(json.loads(row_[12])))
    finite = [r for r in rows if r[5]]
    # ``last``: the value of the rank that got furthest (the lowest such rank on a tie).
    newest = max(rows, key=lambda r: (r[3] if r[3] is not None else -1, -r[0]))
    p50, p95, p99 = sketch.quantiles()
    return (run, ALL_RANKS, metric, start, rows[0][1],
            min((r[2] for r in rows if r[2] is not None), default=None),
            max((r[3] for r in rows if r[3] is not None), default=None),
            max((r[4] or 0 for r in rows), default=None), len(rows), n, nonfinite,
            mean if n else None, math.sqrt(m2 / (n - 1)) if n > 1 else 0.0,
            min((r[9] for r in finite), default=None), max((r[10] for r in finite), default=None), newest[11],
            _real(p50), _real(p95), _real(p99), json.dumps(sketch.to_wire(), separators=(",", ":")) if n else None,
            max(r[13] for r in rows))


def step_range(r: Rollup) -> tuple[int, int]:
    """The steps the window saw, where the rollup says (else the window's bounds)."""
    first = r.first_step if r.first_step is not None else r.start_step
    last = r.last_step if r.last_step is not None else r.end_step - 1
    return first, last


def world_size(r: Rollup) -> int:
    # Rollups from before they carried the world size name their rank only: a lower bound.
    return r.world_size if r.world_size is not None else r.rank + 1


def _real(x: float) -> float | None:
    return None if math.isnan(x) else x  # what SQLite stores for NaN anyway: both databases read alike
