"""What the HTML report and the run comparison draw, read from the report store as plain JSON-able dicts.

One function per view, so the HTML page, ``--json`` and the comparison share the same numbers. A rollup
window is drawn at its middle step; eval metrics at the step they evaluated. Non-finite values stay
``nan`` here; the page's JSON encoder turns them into null (a gap in a line).
"""

from __future__ import annotations

import math
from collections import defaultdict

from rankwatch.contract import EvalReport
from rankwatch.sinks.store_query import Queries

#: Metrics drawn per rank (throughput and step time), in this order when present.
PER_RANK_METRICS = ("step_time_s", "compute_time_s", "samples_per_s", "tokens_per_s", "data_wait_s",
                    "collective_time_s")
#: The heatmap's default metric: the first of these the run logged. compute_time_s first: under DDP every
#: rank's step_time_s is the slowest one's, so only the time outside collectives names a straggler.
HEATMAP_DEFAULTS = ("compute_time_s", "step_time_s", "samples_per_s", "tokens_per_s")


def window_step(r: dict) -> float:
    """The step a rollup window is drawn at: the middle of the steps it saw (or of its bounds)."""
    first, last = r.get("first_step"), r.get("last_step")
    if first is None or last is None:
        first, last = r["start_step"], r["end_step"] - 1
    return (first + last) / 2


def final_reports(reports: list[EvalReport]) -> list[EvalReport]:
    """One report per evaluation, the newest revision (the store keeps only that), by step."""
    newest: dict[str, EvalReport] = {}
    for r in reports:
        if r.eval_id not in newest or r.revision > newest[r.eval_id].revision:
            newest[r.eval_id] = r
    return sorted(newest.values(), key=lambda r: (r.step, r.eval_id))


def eval_series(reports: list[EvalReport]) -> dict[str, dict]:
    """``{metric: {"steps", "mean", "lo", "hi", "n"}}``: each eval metric over steps with its 95% CI;
    ``composite`` too when the reports carry one."""
    out: dict[str, dict] = {}
    for r in final_reports(reports):
        for name, m in r.metrics.items():
            s = out.setdefault(name, {"steps": [], "mean": [], "lo": [], "hi": [], "n": []})
            s["steps"].append(r.step)
            s["mean"].append(m["mean"])
            s["lo"].append(m.get("ci_low", math.nan))
            s["hi"].append(m.get("ci_high", math.nan))
            s["n"].append(m.get("n", 0))
        if r.composite is not None:
            s = out.setdefault("composite", {"steps": [], "mean": [], "lo": [], "hi": [], "n": []})
            s["steps"].append(r.step)
            s["mean"].append(r.composite)
            s["lo"].append(math.nan)
            s["hi"].append(math.nan)
            s["n"].append(r.n_samples)
    return out


def curves(rollups: list[dict]) -> dict[str, dict]:
    """``{metric: {"steps", "mean", "p50", "p95", "min", "max"}}`` from the run-wide windows (merged across
    ranks); a run stored before run-wide rows existed falls back to the mean over its ranks' windows."""
    run_wide = [r for r in rollups if r["rank"] is None]
    rows = run_wide or rollups
    by_metric: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_metric[r["metric"]][window_step(r)].append(r)
    out = {}
    for metric, windows in sorted(by_metric.items()):
        s = {"steps": [], "mean": [], "p50": [], "p95": [], "min": [], "max": []}
        for step in sorted(windows):
            group = windows[step]
            s["steps"].append(step)
            s["mean"].append(_mean([g["mean"] for g in group]))
            for q in ("p50", "p95"):
                s[q].append(_mean([g.get(q, math.nan) for g in group]))
            s["min"].append(min((g["min"] for g in group), default=math.nan))
            s["max"].append(max((g["max"] for g in group), default=math.nan))
        out[metric] = s
    return out


def per_rank(rollups: list[dict], metrics=PER_RANK_METRICS) -> dict[str, dict[str, dict]]:
    """``{metric: {rank: {"steps", "mean"}}}`` for the throughput and step-time metrics, one line per rank."""
    out: dict[str, dict[str, dict]] = {}
    for r in sorted((r for r in rollups if r["rank"] is not None and r["metric"] in metrics),
                    key=lambda r: (r["metric"], r["rank"], r["start_step"])):
        s = out.setdefault(r["metric"], {}).setdefault(str(r["rank"]), {"steps": [], "mean": []})
        s["steps"].append(window_step(r))
        s["mean"].append(r["mean"])
    return {m: out[m] for m in metrics if m in out}


def heatmap(rollups: list[dict], metric: str | None = None) -> dict | None:
    """A rank × window matrix of one metric's window means, and each cell's ratio to its window's median
    across ranks: a straggler is a row of high ratios (a stripe), whatever the run's overall drift."""
    ranked = [r for r in rollups if r["rank"] is not None]
    logged = {r["metric"] for r in ranked}
    if metric is None:
        metric = next((m for m in HEATMAP_DEFAULTS if m in logged), min(logged) if logged else None)
    if metric is None or metric not in logged:
        return None
    rows = [r for r in ranked if r["metric"] == metric]
    ranks = sorted({r["rank"] for r in rows})
    starts = sorted({r["start_step"] for r in rows})
    col = {s: i for i, s in enumerate(starts)}
    row = {k: i for i, k in enumerate(ranks)}
    values = [[math.nan] * len(starts) for _ in ranks]
    for r in rows:
        values[row[r["rank"]]][col[r["start_step"]]] = r["mean"]
    ratios = [[math.nan] * len(starts) for _ in ranks]
    for j in range(len(starts)):
        column = sorted(v for v in (values[i][j] for i in range(len(ranks))) if math.isfinite(v))
        median = column[len(column) // 2] if column else math.nan
        for i in range(len(ranks)):
            if math.isfinite(values[i][j]) and median and math.isfinite(median):
                ratios[i][j] = values[i][j] / median
    return {"metric": metric, "ranks": ranks, "steps": starts, "values": values, "ratio": ratios}


def consistency(reports: list[EvalReport], alerts: list[dict]) -> dict | None:
    """The newest complete evaluation's per-rank means beside the run's, and which ranks the workers'
    consistency test named (its ``eval_consistency`` alerts for that evaluation's step)."""
    done = [r for r in final_reports(reports) if r.per_rank]
    if not done:
        return None
    last = done[-1]
    named: dict[tuple[str, int], str] = {}
    for a in alerts:
        if a["detector"] == "eval_consistency" and a["status"] == "firing" and a["step"] == last.step:
            for rank in a["ranks"] or ([a["rank"]] if a["rank"] is not None else []):
                named[(a["metric"], rank)] = a["message"]
    metrics = sorted(last.metrics)
    rows = []
    for rank in sorted(last.per_rank, key=int):
        cells = []
        for m in metrics:
            mine = last.per_rank[rank].get(m, {})
            cells.append({"metric": m, "mean": mine.get("mean", math.nan), "n": mine.get("n", 0),
                          "differs": (m, int(rank)) in named, "message": named.get((m, int(rank)), "")})
        rows.append({"rank": int(rank), "cells": cells})
    overall = [{"metric": m, "mean": last.metrics[m]["mean"], "lo": last.metrics[m].get("ci_low", math.nan),
                "hi": last.metrics[m].get("ci_high", math.nan)} for m in metrics]
    return {"eval_id": last.eval_id, "step": last.step, "metrics": metrics, "overall": overall, "ranks": rows,
            "flagged": len(named)}


def run_view(q: Queries, run: str, *, heatmap_metric: str | None = None) -> dict:
    """Everything the report draws for one run."""
    reports = q.eval_reports(run)
    rollups = q.rollups(run)
    alerts = q.alerts(run)
    return {
        "run": run,
        "eval": eval_series(reports),
        "curves": curves(rollups),
        "per_rank": per_rank(rollups),
        "heatmap": heatmap(rollups, heatmap_metric),
        "alerts": [{k: a[k] for k in ("key", "status", "severity", "detector", "metric", "rank", "ranks", "step",
                                      "incident", "value", "message", "ts")} for a in alerts],
        "consistency": consistency(reports, alerts),
    }


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan
