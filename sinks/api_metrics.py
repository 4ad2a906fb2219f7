"""``/metrics``: the store's latest rollups and firing alerts as Prometheus gauges, read at scrape time.

A custom collector on an injected registry (nothing global). Series stay bounded: only runs seen in
the last ``max_age_s``, each (run, metric)'s newest window, ranks below ``max_ranks`` (the row merged
across ranks, ``rank="all"``, always), and one series per firing alert condition.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rankwatch.sinks.store_query import Queries

#: Rollup fields exported, each as ``rankwatch_rollup_<field>``; the names the Grafana dashboard queries.
ROLLUP_GAUGES = {
    "mean": "Mean of the metric's finite values in its newest rollup window",
    "p50": "Median of the window (t-digest)",
    "p95": "95th percentile of the window (t-digest)",
    "p99": "99th percentile of the window (t-digest)",
    "min": "Smallest finite value in the window",
    "max": "Largest finite value in the window",
    "last": "Last value in the window",
    "count": "Finite values in the window",
    "nonfinite": "NaN and infinite values in the window",
}


class StoreCollector(Collector):
    def __init__(self, queries: Callable[[], Queries], *, max_ranks: int = 64, max_age_s: float = 86_400.0):
        if max_ranks < 0:
            raise ValueError("max_ranks must be >= 0")
        self.queries, self.max_ranks, self.max_age_s = queries, max_ranks, max_age_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        q = self.queries()
        recent = [r["run"] for r in q.runs() if (r["last_ts"] or 0) >= time.time() - self.max_age_s]
        families = {name: GaugeMetricFamily(f"rankwatch_rollup_{name}", doc, labels=["run", "metric", "rank"])
                    for name, doc in ROLLUP_GAUGES.items()}
        step = GaugeMetricFamily("rankwatch_rollup_last_step", "Last step seen in the newest window",
                                 labels=["run", "metric", "rank"])
        for run in recent:
            for r in q.latest_rollups(run, self.max_ranks):
                labels = [run, r["metric"], "all" if r["rank"] is None else str(r["rank"])]
                for name, family in families.items():
                    value = r[name]
                    if value is not None and not (isinstance(value, float) and math.isnan(value)):
                        family.add_metric(labels, float(value))
                if r["last_step"] is not None:
                    step.add_metric(labels, float(r["last_step"]))
        yield from families.values()
        yield step
        firing = GaugeMetricFamily("rankwatch_alert_firing", "1 for each alert condition that is firing now",
                                   labels=["run", "detector", "metric", "severity", "rank"])
        for a in q.firing():
            if a["run"] in recent:
                firing.add_metric([a["run"], a["detector"], a["metric"], a["severity"],
                                   "" if a["rank"] is None else str(a["rank"])], 1.0)
        yield firing
