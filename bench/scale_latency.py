"""NaN-to-alert latency at cluster scale (issue 16, goal 2): N quiet ranks and one real publisher.

One run of N + 1 ranks, M metrics each, one step a second. Ranks 1..N are simulated
(``rankwatch.sim.QuietRanks``, the documented JSON format) by a separate process through a plain
producer; rank 0 is a real ``RankPublisher`` (sender thread, spool, shipper process) in this
process, logging the same kind of values, and every ``--gap-steps`` steps its ``loss`` is NaN. The
latency is from that ``log()`` call to the firing ``nonfinite`` alert being readable on
``rankwatch.alerts`` by a plain consumer. Any alert about a quiet rank is counted as false. One
worker, the embedded broker; the broker, the worker, the simulator and this process share the
machine's cores. Prints a table; asserts nothing.

Then, unless ``--no-prometheus``, the same N ranks through Prometheus + Alertmanager
(``bench/prometheus_baseline.py``), after the rankwatch stack has stopped so that neither shares the
cores with the other, and one table of both latencies and their ratio (Prometheus / rankwatch).
Without the Debian packages ``prometheus`` and ``prometheus-alertmanager`` it says so and skips them.

    python bench/scale_latency.py --ranks 128 1024 --trials 30
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert, UrgentTelemetry
from rankwatch.producers import RankPublisher
from rankwatch.settings import Settings
from rankwatch.sim import SHAPES, QuietRanks, paced
from rankwatch.stack import Stack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prometheus_baseline import binaries, exit_on_sigterm, measure_prometheus  # noqa: E402
from scratch import scratch_dir  # noqa: E402

WARMUP_STEPS = 20  # detectors warm up, and the worker joins, before the first NaN


def _simulate(bootstrap: str, run: str, ranks: int, metrics: int, ticks: int, start_at: float,
              binary: bool = False, shape: str = "flat") -> None:
    time.sleep(max(0.0, start_at - time.time()))
    sim = QuietRanks(run=run, ranks=ranks, first_rank=1, world_size=ranks + 1, metrics=metrics, binary=binary,
                     shape=shape)
    paced(bootstrap, [sim], hz=1.0, ticks=ticks)


class AlertWatch(threading.Thread):
    """Notes when each firing nonfinite alert of rank 0 is readable, and every alert on another rank."""

    def __init__(self, bootstrap: str, run: str):
        super().__init__(daemon=True)
        self.bootstrap, self.run_id = bootstrap, run  # not self.run: that is Thread's method
        self.seen_at: dict[int, float] = {}  # incident step -> time read
        self.made_at: dict[int, float] = {}  # incident step -> the alert's ts: when the worker made it
        self.lane_at: dict[int, float] = {}  # step -> when rank 0's NaN was readable on rankwatch.urgent
        self.false: list[Alert] = []
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:  # noqa: D102 (Thread.run)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, fetch_max_wait_ms=10, enable_auto_commit=False)
        tps = [TopicPartition(topic, p) for topic in (contract.ALERTS, contract.URGENT)
               for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        consumer.poll(timeout_ms=0)
        self.ready.set()
        while not self.stop.is_set():
            for records in consumer.poll(timeout_ms=20).values():
                now = time.time()
                for r in records:
                    if r.topic == contract.URGENT:
                        self._lane(r.value, now)
                        continue
                    a = Alert.from_bytes(r.value)
                    if a.run != self.run_id or a.status != "firing":
                        continue
                    ranks = set(a.ranks) | ({a.rank} if a.rank is not None else set())
                    if a.detector == "nonfinite" and ranks == {0}:
                        self.seen_at.setdefault(a.incident, now)
                        self.made_at.setdefault(a.incident, a.ts)
                    elif ranks - {0} or a.rank is None:
                        self.false.append(a)
        consumer.close()

    def _lane(self, value: bytes, now: float) -> None:
        batch = UrgentTelemetry.from_bytes(value)
        loss = batch.series.get("loss")
        if batch.run == self.run_id and batch.rank == 0 and loss is not None:
            for step in loss.steps[~np.isfinite(loss.values)].tolist():
                self.lane_at.setdefault(step, now)


def measure(bootstrap: str, ranks: int, metrics: int, trials: int, gap: int, binary: bool = False,
            shape: str = "flat") -> dict:
    run = f"scale-{ranks}-{time.time_ns()}"
    ticks = WARMUP_STEPS + trials * gap + 3
    watch = AlertWatch(bootstrap, run)
    watch.start()
    watch.ready.wait(30)
    start_at = time.time() + 2.0  # the simulator process imports and connects meanwhile
    sim = multiprocessing.get_context("spawn").Process(
        target=_simulate, args=(bootstrap, run, ranks, metrics, ticks, start_at, binary, shape), daemon=True)
    sim.start()
    me = QuietRanks(run=run, ranks=1, world_size=ranks + 1, metrics=metrics, shape=shape)
    publisher = RankPublisher(run=run, rank=0, world_size=ranks + 1, bootstrap=bootstrap, samplers=[])
    sent_at: dict[int, float] = {}
    time.sleep(max(0.0, start_at - time.time()))
    for step in range(ticks):
        time.sleep(max(0.0, start_at + step - time.time()))
        values = me.values(0, step, np.array([step]))[:, 0]
        metrics_now = dict(zip(me.names, values.tolist()))
        if step >= WARMUP_STEPS and (step - WARMUP_STEPS) % gap == 0 and len(sent_at) < trials:
            metrics_now["loss"] = float("nan")
            sent_at[step] = time.time()
        publisher.log(metrics_now, step)
    publisher.close()
    sim.join(60)
    time.sleep(3.0)
    watch.stop.set()
    watch.join()
    lat = np.array([watch.seen_at[s] - t for s, t in sent_at.items() if s in watch.seen_at]) * 1000
    # Where the time went: log() to the worker's alert (publisher, shipper, broker, the worker's
    # queue and grouping wait), then the alert to this reader (broker, fetch).
    made = np.array([watch.made_at[s] - t for s, t in sent_at.items() if s in watch.made_at]) * 1000
    lane = np.array([watch.lane_at[s] - t for s, t in sent_at.items() if s in watch.lane_at]) * 1000
    hop = np.array([watch.seen_at[s] - watch.made_at[s] for s in sent_at if s in watch.seen_at]) * 1000
    return {"ranks": ranks, "trials": len(sent_at), "missed": len(sent_at) - len(lat), "p50": _pct(lat, 50),
            "p99": _pct(lat, 99), "max": _pct(lat, 100), "false": len(watch.false),
            "made_p50": _pct(made, 50), "made_p99": _pct(made, 99), "lane_p50": _pct(lane, 50), "lane_p99": _pct(lane, 99),
            "hop_p50": _pct(hop, 50), "hop_p99": _pct(hop, 99),
            "false_kinds": sorted({f"{a.detector}:{a.metric}" for a in watch.false})}


def _pct(ms: np.ndarray, q: float) -> float:
    return float(np.percentile(ms, q)) if len(ms) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--metrics", type=int, default=32)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--gap-steps", type=int, default=8, help="steps between NaNs (the alert resolves in 5)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--no-prometheus", action="store_true", help="skip the Prometheus + Alertmanager baseline")
    ap.add_argument("--format", choices=["json", "binary"], default="json",
                    help="the quiet ranks' wire format (rank 0's publisher writes binary, its default)")
    ap.add_argument("--shape", choices=SHAPES, default="flat",
                    help="training: every rank's loss and grad norm fall as in a real run (rankwatch.sim)")
    args = ap.parse_args()
    settings = Settings(data_dir=scratch_dir("scale-latency"), partitions=args.partitions)
    rows = []
    with Stack(settings, embedded=True, port=free_port()) as stack:
        for n in args.ranks:
            print(f"measuring {n} quiet ranks + 1 publisher, {args.trials} NaNs …", flush=True)
            rows.append(measure(stack.bootstrap, n, args.metrics, args.trials, args.gap_steps, args.format == "binary",
                                args.shape))
    load = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {load[0]:.1f}/{load[1]:.1f}; "
          f"NaN-to-alert, 1 worker, {args.metrics} metrics per rank, 1 step/s, quiet ranks in {args.format}, "
          f"{args.shape} series")
    print("| quiet ranks | values/s | NaNs | missed | p50 ms | p99 ms | max ms | readable on rankwatch.urgent p50 / p99 ms "
          "| to the worker's alert p50 / p99 ms | the alert to its reader p50 / p99 ms | alerts on quiet ranks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kinds = f" ({', '.join(r['false_kinds'])})" if r["false"] else ""
        print(f"| {r['ranks']} | {(r['ranks'] + 1) * args.metrics:,} | {r['trials']} | {r['missed']} | {r['p50']:.0f} "
              f"| {r['p99']:.0f} | {r['max']:.0f} | {r['lane_p50']:.0f} / {r['lane_p99']:.0f} | {r['made_p50']:.0f} / {r['made_p99']:.0f} "
              f"| {r['hop_p50']:.0f} / {r['hop_p99']:.0f} | {r['false']}{kinds} |")
    if not args.no_prometheus:
        compare_with_prometheus(rows, args.metrics, args.trials, args.gap_steps)


def compare_with_prometheus(rows: list[dict], metrics: int, trials: int, gap: int) -> None:
    if binaries() is None:
        print("\nPrometheus + Alertmanager baseline skipped: no `prometheus` and/or `prometheus-alertmanager` "
              "on PATH (apt-get install prometheus prometheus-alertmanager)")
        return
    exit_on_sigterm()  # a SIGTERM now unwinds, so Prometheus and its exporters are stopped with the bench
    baseline = []
    for r in rows:
        print(f"measuring Prometheus + Alertmanager on {r['ranks']} quiet ranks + rank 0, {trials} NaNs …", flush=True)
        baseline.append(measure_prometheus(r["ranks"], metrics, trials, gap))
    print("\nNaN-to-alert, rankwatch (1 worker, embedded broker) against Prometheus + Alertmanager "
          "(1 s scrape and evaluation intervals, group_wait 0s)")
    print("| quiet ranks | rankwatch p50 ms | rankwatch p99 ms | Prometheus p50 ms | Prometheus p99 ms "
          "| ratio p50 | ratio p99 | Prometheus missed | Prometheus alerts on quiet ranks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, b in zip(rows, baseline, strict=True):
        print(f"| {r['ranks']} | {r['p50']:.0f} | {r['p99']:.0f} | {b['p50']:.0f} | {b['p99']:.0f} "
              f"| {b['p50'] / r['p50']:.1f} | {b['p99'] / r['p99']:.1f} | {b['missed']}/{b['trials']} | {b['false']} |")


if __name__ == "__main__":
    main()
