"""Reading the report store: rollups, eval reports, alerts and runs, with filters.

Shared by ``rankwatch report`` / ``rankwatch runs`` and the HTTP API, so both answer alike. Rows come
back as plain dicts of JSON-able values (non-finite floats as Python floats; callers encode them).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime

from rankwatch.contract import EvalReport
from rankwatch.sinks.store import Database
from rankwatch.sinks.store_rollups import COLUMNS as ROLLUP_COLUMNS
from rankwatch.sinks.store_schema import ALL_RANKS

ROLLUP_FIELDS = tuple(c for c in ROLLUP_COLUMNS if c != "sketch")
ALERT_FIELDS = ("key", "status", "incident", "ranks", "run", "severity", "detector", "metric", "rank", "step",
                "value", "score", "message", "ts")
FLOATS = {"mean", "std", "min", "max", "last", "p50", "p95", "p99", "value", "score"}


@dataclass(frozen=True)
class Filters:
    """What a query keeps. ``rank``: a rank, ``"all"`` for the rows merged across ranks, or None for every row.
    ``steps``: inclusive bounds, either may be None. ``since``: Unix seconds."""

    metric: str | None = None
    rank: int | str | None = None
    steps: tuple[int | None, int | None] = (None, None)
    since: float | None = None
    limit: int | None = None


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"``, ``"A:"`` or ``":B"`` (inclusive) → bounds.

    >>> parse_steps("100:200"), parse_steps("100:"), parse_steps(":50")
    ((100, 200), (100, None), (None, 50))
    """
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"steps must look like A:B, A: or :B, got {text!r}") from None


def parse_since(text: str, now: float | None = None) -> float:
    """Unix seconds, an ISO date-time, or an age like ``30s``, ``15m``, ``2h``, ``1d`` → Unix seconds.

    >>> parse_since("90s", now=1000.0), parse_since("1700000000")
    (910.0, 1700000000.0)
    """
    now = time.time() if now is None else now
    if m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text):
        return now - float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"since must be Unix seconds, an ISO date-time or an age like 15m, got {text!r}") from None


class Queries:
    def __init__(self, db: Database):
        self.db = db

    def runs(self) -> list[dict]:
        rows = self.db.query("SELECT run, first_step, last_step, world_size, first_ts, last_ts FROM runs ORDER BY last_ts")
        counts: dict[str, dict] = {}
        # One row per condition (key, incident): its latest transition says whether it still fires.
        for run, key, incident, status in self.db.query(
                "SELECT run, key, incident, status FROM alerts ORDER BY ts"):
            c = counts.setdefault(run, {"alerts": 0, "firing": {}})
            c["alerts"] += status == "firing"
            c["firing"][(key, incident)] = status == "firing"
        out = []
        for run, first, last, world, first_ts, last_ts in rows:
            c = counts.get(run, {"alerts": 0, "firing": {}})
            out.append({"run": run, "first_step": first, "last_step": last, "world_size": world,
                        "first_ts": first_ts, "last_ts": last_ts, "alerts": c["alerts"],
                        "firing": sum(c["firing"].values())})
        return out

    def metrics(self, run: str) -> list[dict]:
        rows = self.db.query(
            "SELECT metric, COUNT(*), MIN(start_step), MAX(end_step) FROM rollups WHERE run = ? AND rank = ? "
            "GROUP BY metric ORDER BY metric", (run, ALL_RANKS))
        if not rows:  # rollups from before run-wide rows existed
            rows = self.db.query("SELECT metric, COUNT(*), MIN(start_step), MAX(end_step) FROM rollups "
                                 "WHERE run = ? GROUP BY metric ORDER BY metric", (run,))
        return [{"metric": m, "windows": n, "start_step": lo, "end_step": hi} for m, n, lo, hi in rows]

    def rollups(self, run: str, f: Filters = Filters()) -> list[dict]:
        where, params = ["run = ?"], [run]
        if f.metric is not None:
            where.append("metric = ?")
            params.append(f.metric)
        if f.rank is not None:
            where.append("rank = ?")
            params.append(ALL_RANKS if f.rank == "all" else int(f.rank))
        lo, hi = f.steps
        if lo is not None:
            where.append("end_step > ?")
            params.append(lo)
        if hi is not None:
            where.append("start_step <= ?")
            params.append(hi)
        if f.since is not None:
            where.append("ts >= ?")
            params.append(f.since)
        sql = (f"SELECT {', '.join(ROLLUP_FIELDS)} FROM rollups WHERE {' AND '.join(where)} "
               "ORDER BY start_step, metric, rank")
        if f.limit is not None:
            sql += f" LIMIT {int(f.limit)}"
        return [_rollup(dict(zip(ROLLUP_FIELDS, row))) for row in self.db.query(sql, params)]

    def eval_reports(self, run: str, f: Filters = Filters()) -> list[EvalReport]:
        where, params = ["run = ?"], [run]
        lo, hi = f.steps
        for cond, value in (("step >= ?", lo), ("step <= ?", hi), ("ts >= ?", f.since)):
            if value is not None:
                where.append(cond)
                params.append(value)
        rows = self.db.query(f"SELECT body FROM eval_reports WHERE {' AND '.join(where)} ORDER BY step, eval_id",
                             params)
        reports = [EvalReport.from_bytes(body.encode()) for (body,) in rows]
        if f.metric is None and f.rank is None:
            return reports
        return [_narrow(r, f) for r in reports]

    def alerts(self, run: str, f: Filters = Filters()) -> list[dict]:
        where, params = ["run = ?"], [run]
        lo, hi = f.steps
        for cond, value in (("metric = ?", f.metric), ("step >= ?", lo), ("step <= ?", hi), ("ts >= ?", f.since)):
            if value is not None:
                where.append(cond)
                params.append(value)
        rows = self.db.query(f"SELECT {', '.join(ALERT_FIELDS)} FROM alerts WHERE {' AND '.join(where)} "
                             "ORDER BY ts, key", params)
        out = []
        for row in rows:
            a = dict(zip(ALERT_FIELDS, row))
            a["ranks"] = json.loads(a["ranks"])
            a["value"], a["score"] = _float(a["value"]), _float(a["score"])
            if f.rank in (None, "all") or int(f.rank) in a["ranks"] or a["rank"] == int(f.rank):
                out.append(a)
        return out[: f.limit] if f.limit is not None else out

    def firing(self) -> list[dict]:
        """Every alert condition whose latest transition is ``firing``, across runs."""
        latest: dict[tuple, dict] = {}
        for row in self.db.query(f"SELECT {', '.join(ALERT_FIELDS)} FROM alerts ORDER BY ts"):
            a = dict(zip(ALERT_FIELDS, row))
            latest[(a["key"], a["incident"])] = a
        return [a for a in latest.values() if a["status"] == "firing"]

    def latest_rollups(self, run: str, max_ranks: int) -> list[dict]:
        """Each (metric, rank)'s newest window in ``run``: the run-wide row of each metric's newest window,
        and each rank below ``max_ranks`` at that window or the one before (a rank further behind is stale
        and left out). Two indexed lookups per metric, not a scan of the run."""
        latest = self.db.query(
            "SELECT metric, MAX(start_step), MAX(end_step - start_step) FROM rollups WHERE run = ? AND rank = ? "
            "GROUP BY metric", (run, ALL_RANKS))
        world = self.db.query("SELECT world_size FROM runs WHERE run = ?", (run,))
        # Named ranks, not `rank < N`: an IN list is one index seek per rank, a range scans their history.
        ranks = [ALL_RANKS, *range(min(max_ranks, (world[0][0] or 0) if world else 0))]
        marks = ", ".join("?" * len(ranks))
        out = []
        for metric, start, width in latest:
            rows = self.db.query(
                f"SELECT {', '.join(ROLLUP_FIELDS)} FROM rollups WHERE run = ? AND metric = ? AND rank IN ({marks}) "
                "AND start_step >= ? ORDER BY rank, start_step", (run, metric, *ranks, start - width))
            newest = {row[1]: row for row in rows}  # by rank; the later window wins
            out += [_rollup(dict(zip(ROLLUP_FIELDS, row))) for row in newest.values()]
        return out


def _rollup(d: dict) -> dict:
    for name in FLOATS & d.keys():
        d[name] = _float(d[name])
    if d["rank"] == ALL_RANKS:
        d["rank"] = None  # merged across ranks; ``ranks`` says how many
    return d


def _float(x) -> float:
    return math.nan if x is None else float(x)


def _narrow(r: EvalReport, f: Filters) -> EvalReport:
    """The report with only the metric (and rank) asked for."""
    from dataclasses import replace

    metrics = {k: v for k, v in r.metrics.items() if f.metric is None or k == f.metric}
    keep_rank = None if f.rank in (None, "all") else str(f.rank)
    per_rank = {rank: {k: v for k, v in m.items() if f.metric is None or k == f.metric}
                for rank, m in r.per_rank.items() if keep_rank is None or rank == keep_rank}
    return replace(r, metrics=metrics, per_rank=per_rank)
