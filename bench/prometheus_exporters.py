"""The simulated ranks of the Prometheus baseline as prometheus-client exporters: one gauge per metric,
labelled ``rank``, 256 quiet ranks per exporter process (run as this file), and rank 0 served from
the bench's own process. ``bench/prometheus_baseline.py`` says what is measured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_processes import HOST, start, wait_ready

from rankwatch.broker import free_port
from rankwatch.sim import QuietRanks

RANKS_PER_TARGET = 256  # a scrape of 256 ranks x 32 metrics costs a Python exporter ~0.15 CPU s (OpenMetrics, gzip)


def prom_name(metric: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_:]", "_", metric)



class QuietCollector:
    """Ranks ``first .. first + count - 1`` as gauges; a scrape serves the values of the current step."""

    def __init__(self, first: int, count: int, metrics: int, t0: float):
        self.sim = QuietRanks(run="prometheus", ranks=count, first_rank=first, metrics=metrics)
        self.names = [prom_name(n) for n in self.sim.names]
        self.ranks = range(first, first + count)
        self.t0 = t0
        self.cached: tuple[int, np.ndarray] | None = None

    def _values(self) -> np.ndarray:
        # (metrics, ranks) for this step, computed once per step: scrapes may come more than once a step
        step = max(0, int(time.time() - self.t0))
        if self.cached is None or self.cached[0] != step:
            steps = np.array([step])
            self.cached = step, np.stack([self.sim.values(r, step, steps)[:, 0] for r in self.ranks], axis=1)
        return self.cached[1]

    def collect(self):
        values = self._values()
        for i, name in enumerate(self.names):
            family = GaugeMetricFamily(name, f"{self.sim.names[i]} of each rank", labels=["rank"])
            for j, rank in enumerate(self.ranks):
                family.add_metric([str(rank)], float(values[i, j]))
            yield family


class Rank0Collector:
    """Rank 0's gauges as the bench sets them; the NaN ``loss`` carries its incident's number."""

    def __init__(self, metrics: int):
        self.sim = QuietRanks(run="prometheus", ranks=1, metrics=metrics)
        self.names = [prom_name(n) for n in self.sim.names]
        self.state: tuple[np.ndarray, str] = (self.sim.values(0, 0, np.array([0]))[:, 0], "")

    def set_step(self, step: int, incident: str = "") -> None:
        values = self.sim.values(0, step, np.array([step]))[:, 0]
        if incident:
            values[0] = np.nan
        self.state = (values, incident)  # one assignment: a scrape sees a whole step, never half of one

    def collect(self):
        values, incident = self.state
        for i, name in enumerate(self.names):
            labels = ["rank", "incident"] if i == 0 else ["rank"]  # an empty label is no label to Prometheus
            family = GaugeMetricFamily(name, f"{self.sim.names[i]} of each rank", labels=labels)
            family.add_metric(["0", incident] if i == 0 else ["0"], float(values[i]))
            yield family


def serve_quiet(first: int, count: int, metrics: int, port: int, t0: float) -> None:
    """An exporter process's life: serve until terminated, or until the bench that started it is gone."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QuietCollector(first, count, metrics, t0))
    start_http_server(port, addr=HOST, registry=registry)
    parent = os.getppid()
    while os.getppid() == parent:  # a bench killed with SIGKILL cannot stop us; notice it instead
        time.sleep(1.0)


def start_exporters(stack, tmp: Path, ranks: int, metrics: int, t0: float) -> list[tuple[str, subprocess.Popen]]:
    """The quiet ranks' exporter processes, (target, process) of each, once each answers."""
    started = []
    for first in range(1, ranks + 1, RANKS_PER_TARGET):
        count, port = min(RANKS_PER_TARGET, ranks + 1 - first), free_port()
        log = tmp / f"exporter-{first}.log"
        proc = start(stack, [sys.executable, os.path.abspath(__file__),
                              str(first), str(count), str(metrics), str(port), repr(t0)], log)
        started.append((f"{HOST}:{port}", proc, log))
    for target, proc, log in started:
        wait_ready(f"http://{target}/metrics", proc, log)
    return [(target, proc) for target, proc, _ in started]


if __name__ == "__main__":  # an exporter process: first count metrics port t0
    first, count, metrics, port, t0 = sys.argv[1:]
    serve_quiet(int(first), int(count), int(metrics), int(port), float(t0))
