"""Rows for the terminal and CSV: the store's rollups, alerts, eval metrics and runs as (header, rows).

>>> print(format_rows(("metric", "mean"), [("loss", "2.5"), ("grad_norm", "0.75")]))
metric     mean
loss       2.5
grad_norm  0.75
"""

from __future__ import annotations

import math
import time

from rankwatch.contract import EvalReport


def _num(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return "NaN" if math.isnan(x) else f"{x:.6g}"
    return str(x)


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def rollup_rows(rollups: list[dict]) -> tuple[tuple, list[tuple]]:
    header = ("metric", "rank", "ranks", "start_step", "end_step", "count", "nonfinite", "mean", "std", "min", "max",
              "last", "p50", "p95", "p99")
    rows = [(r["metric"], "all" if r["rank"] is None else r["rank"], *(_num(r[h]) for h in header[2:]))
            for r in rollups]
    return header, rows


def alert_rows(alerts: list[dict]) -> tuple[tuple, list[tuple]]:
    header = ("time", "status", "severity", "detector", "metric", "rank", "ranks", "step", "value", "message")
    rows = [(_when(a["ts"]), a["status"], a["severity"], a["detector"], a["metric"], _num(a["rank"]),
             " ".join(map(str, a["ranks"])), a["step"], _num(a["value"]), a["message"]) for a in alerts]
    return header, rows


def eval_rows(reports: list[EvalReport]) -> tuple[tuple, list[tuple]]:
    header = ("eval_id", "step", "complete", "revision", "metric", "n", "nonfinite", "mean", "std", "ci_low",
              "ci_high", "method")
    rows = [(r.eval_id, r.step, r.complete, r.revision, name, m.get("n"), m.get("nonfinite", ""),
             *(_num(m.get(k)) for k in ("mean", "std", "ci_low", "ci_high")), m.get("method"))
            for r in reports for name, m in sorted(r.metrics.items())]
    return header, rows


def run_rows(runs: list[dict]) -> tuple[tuple, list[tuple]]:
    header = ("run", "first_step", "last_step", "world_size", "alerts", "firing", "last_seen")
    rows = [(r["run"], _num(r["first_step"]), _num(r["last_step"]), _num(r["world_size"]), r["alerts"], r["firing"],
             _when(r["last_ts"])) for r in runs]
    return header, rows


def format_rows(header: tuple, rows: list[tuple]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    cells = [tuple(map(str, header)), *(tuple(map(str, r)) for r in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
