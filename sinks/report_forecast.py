"""Forecasts of one run from the report store: each eval metric, and each training metric a rule names.

Shared by ``rankwatch report --forecast``, the HTML report and the API's ``/runs/{run}/forecast``. Training
metrics are forecast on their run-wide window means; a metric named only by the ``nonfinite`` or
``crossrank`` rules (every metric, and step times) has no trend worth forecasting and is left out.
"""

from __future__ import annotations

from rankwatch.forecast import forecast
from rankwatch.sinks.report_data import curves, eval_series
from rankwatch.sinks.store_query import Filters, Queries

#: Rules that name a metric without saying anything about its trend.
NOT_TREND_RULES = {"nonfinite", "crossrank", "stall"}


def watched(metric: str, rules) -> bool:
    """Whether a rule other than the every-metric ones names ``metric``."""
    return any(name not in NOT_TREND_RULES for name in rules.for_metric(metric))


def run_forecasts(q: Queries, run: str, rules=None) -> dict:
    """``{"eval": {metric: forecast}, "training": {metric: forecast}}`` (``rankwatch.forecast.forecast``'s dicts).
    ``rules``: a ``Rules`` (the defaults when None)."""
    from rankwatch.stream_processors.rules import Rules

    rules = rules if rules is not None else Rules.load(None)
    evals = {name: forecast(name, s["steps"], s["mean"]) for name, s in eval_series(q.eval_reports(run)).items()}
    training = {name: forecast(name, s["steps"], s["mean"])
                for name, s in curves(q.rollups(run, Filters(rank="all"))).items() if watched(name, rules)}
    return {"eval": evals, "training": training}


def verdicts(forecasts: dict) -> list[str]:
    """One line per forecast, eval metrics first."""
    return ([f"eval {f['verdict']}" for f in forecasts["eval"].values()]
            + [f"training {f['verdict']}" for f in forecasts["training"].values()])
