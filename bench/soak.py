"""Soak: N quiet simulated ranks at 1 Hz for T minutes; the worker's memory, lag and alerts over time.

Issue 16, goal 3 (4,096 ranks x 32 metrics for 10 minutes: lag under 2 s throughout, worker RSS flat,
nothing dropped) and issue 19, goal 6 (1,024 ranks for 30 minutes on Apache Kafka: RSS growth under
10%, lag bounded):

    python bench/soak.py --broker tansu --ranks 4096 --minutes 10
    python bench/soak.py --broker kafka --ranks 1024 --minutes 30

A fresh local broker (``--broker``) and ``--workers`` workers (``rankwatch.stack.Stack``); a separate
process publishes ``rankwatch.sim.QuietRanks`` at 1 Hz through a plain producer (binary telemetry by
default, as ``RankPublisher`` writes), the last tick ``final``. This process reads ``rankwatch.run_events``
(the progress stage 1 sends for each message it applies) and ``rankwatch.alerts``.

Every ``--every-s`` seconds it prints a row: messages sent, the workers' RSS and CPU, the broker's and
the publishing process's CPU, how busy the whole machine was and how much of its CPU time a virtual
machine's host took for others (so that a growing lag can be told apart: the workers' own cost, a
machine with nothing left, or slower cores), and the lag: how
long ago the newest message the worker has applied from its furthest-behind telemetry partition was
stamped by its rank (so 1 s or so when it keeps up at 1 Hz). At the end, a summary: RSS growth from the
first row after ``--warmup-min`` to the last while the ranks publish, the largest lag over those rows,
how long after the last tick the worker had applied every rank's final message (its backlog then),
how many it applied (all, or some were dropped), and every alert on the run (all false: the ranks
are quiet). Ctrl-C or SIGTERM stops it early with the summary of the rows so far. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import signal
import threading
import time
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.settings import Settings
from rankwatch.sim import SHAPES, QuietRanks, paced
from rankwatch.stack import Stack

from scratch import scratch_dir


def _publish(bootstrap: str, run: str, ranks: int, metrics: int, ticks: int, binary: bool, start_at: float,
             shape: str = "flat") -> None:
    time.sleep(max(0.0, start_at - time.time()))
    paced(bootstrap, [QuietRanks(run=run, ranks=ranks, metrics=metrics, binary=binary, shape=shape)], hz=1.0,
          ticks=ticks)


class RunReader(threading.Thread):
    """Follows the run's progress and alerts: per telemetry partition the newest rank stamp applied,
    which ranks' final messages were applied, and every alert."""

    def __init__(self, bootstrap: str, run: str, ranks: int):
        super().__init__(daemon=True)
        self.bootstrap, self.run_id, self.ranks = bootstrap, run, ranks
        self.newest: dict[int, float] = {}  # telemetry partition -> newest stamp applied
        self.finals: set[int] = set()
        self.all_final_at: float | None = None  # when the last rank's final message was applied
        self.alerts: list[dict] = []
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:  # noqa: D102 (Thread.run)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50)
        tps = [TopicPartition(topic, p) for topic in (contract.RUN_EVENTS, contract.ALERTS)
               for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        consumer.poll(timeout_ms=0)
        self.ready.set()
        while not self.stop.is_set():
            for tp, records in consumer.poll(timeout_ms=200).items():
                for r in records:
                    self._read(tp.topic, json.loads(r.value))
        consumer.close()

    def _read(self, topic: str, obj: dict) -> None:
        if obj.get("run") != self.run_id:
            return
        if topic == contract.ALERTS:
            self.alerts.append(obj)
            return
        for item in obj.get("items", [obj]):  # one rank's progress, or several ranks' in one event
            if "last_step" not in item:
                continue  # an alert on its way to grouping
            p = item.get("partition", -1)
            self.newest[p] = max(self.newest.get(p, 0.0), item["ts"])
            if item.get("final"):
                self.finals.add(item["rank"])
                if len(self.finals) == self.ranks and self.all_final_at is None:
                    self.all_final_at = time.time()

    def lag(self, now: float) -> float:
        return now - min(self.newest.values()) if self.newest else float("nan")


def _proc_stat(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_busy() -> tuple[float, float, float]:
    """(busy, stolen, total) CPU ticks of the whole machine since boot (/proc/stat): its load, whoever
    made it, and the time a virtual machine's host gave its cores to others (every process here then
    needs more CPU time for the same work)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], ticks[7], sum(ticks)  # idle and iowait are not busy


def soak(args) -> dict:
    settings = Settings(data_dir=scratch_dir("soak"), partitions=args.partitions,
                        app_id=f"bench-soak-{time.time_ns()}")
    stack = Stack(settings, embedded=True, port=free_port(), workers=args.workers, broker=args.broker,
                  ready_timeout_s=180)
    stack.with_store = args.store
    run = f"soak-{args.ranks}-{time.time_ns()}"
    ticks = int(args.minutes * 60)
    rows: list[dict] = []
    with stack:
        reader = RunReader(stack.bootstrap, run, args.ranks)
        reader.start()
        reader.ready.wait(60)
        started = time.time() + 5.0  # the publisher's process imports and connects meanwhile
        publisher = multiprocessing.get_context("spawn").Process(
            target=_publish, daemon=True,
            args=(stack.bootstrap, run, args.ranks, args.metrics, ticks, args.format == "binary", started, args.shape))
        publisher.start()
        print(f"{args.ranks} ranks x {args.metrics} metrics at 1 Hz for {args.minutes} min on {args.broker}, "
              f"{args.workers} worker(s), {args.partitions} partitions, {args.shape} series", flush=True)
        print("| min | sent | worker RSS MB | worker CPU % | broker CPU % | publisher CPU % | host busy % | stolen % "
              "| lag s | alerts |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
        try:
            _watch(rows, args, stack, reader, publisher, started, ticks)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a long soak still says what it measured
            print("stopped early: the summary covers the rows printed so far", flush=True)
            publisher.terminate()
        publisher.join(10)
        reader.stop.set()
        reader.join(10)
    if not rows:
        raise SystemExit("stopped before the first row: nothing to sum up")
    # While the ranks publish: after the last tick every open window closes at once, a burst of its own.
    warm = [r for r in rows if r["min"] >= args.warmup_min and r["publishing"]] or rows
    lags = [r["lag"] for r in warm if r["publishing"] and not math.isnan(r["lag"])]  # nan: nothing applied yet
    return {"rows": rows, "rss_first": warm[0]["rss"], "rss_last": warm[-1]["rss"],
            "lag_max": max(lags) if lags else float("nan"), "finals": len(reader.finals), "alerts": reader.alerts,
            "behind_at_end_s": (reader.all_final_at or float("nan")) - (started + ticks - 1)}


def _watch(rows: list[dict], args, stack: Stack, reader: RunReader, publisher, started: float, ticks: int) -> None:
    """A row every ``--every-s`` seconds, printed and added to ``rows``, until the worker is done or gave up."""
    pids = [w.proc.pid for w in stack.workers]
    # What else takes the machine: when the lag grows, whether the workers or the host ran out.
    others = {"broker": stack.broker.pid, "publisher": publisher.pid}
    cpu_before = sum(_proc_stat(pid)[1] for pid in pids)
    others_before = {name: _proc_stat(pid)[1] for name, pid in others.items()}
    host_before = _host_busy()
    drain_until = None
    while True:
        time.sleep(args.every_s)
        now = time.time()
        dead = [w for w in stack.workers if w.proc.poll() is not None]
        if dead:  # a soak is about a running worker: say why one stopped, and stop
            for w in dead:
                print(f"worker {w.index} exited with code {w.proc.returncode}; its last lines:", flush=True)
                print("\n".join(list(w.tail)[-40:]), flush=True)
            raise SystemExit(1)
        stats = [_proc_stat(pid) for pid in pids]
        cpu = sum(c for _, c in stats)
        publishing = publisher.is_alive()
        row = {"min": (now - started) / 60, "sent": min(int(now - started) + 1, ticks) * args.ranks,
               "rss": sum(r for r, _ in stats), "cpu": 100 * (cpu - cpu_before) / args.every_s,
               "lag": reader.lag(now) if publishing else float("nan"), "alerts": len(reader.alerts),
               "publishing": publishing}
        for name, pid in others.items():
            try:
                used = _proc_stat(pid)[1]
            except (OSError, StopIteration):  # the publisher has finished
                used = others_before[name]
            row[name] = 100 * (used - others_before[name]) / args.every_s
            others_before[name] = used
        host = _host_busy()
        total = max(host[2] - host_before[2], 1)
        row["host"], row["stolen"] = 100 * (host[0] - host_before[0]) / total, 100 * (host[1] - host_before[1]) / total
        cpu_before, host_before = cpu, host
        rows.append(row)
        print(f"| {row['min']:.1f} | {row['sent']:,} | {row['rss']:.0f} | {row['cpu']:.0f} | {row['broker']:.0f} "
              f"| {row['publisher']:.0f} | {row['host']:.0f} | {row['stolen']:.0f} | {row['lag']:.1f} | {row['alerts']} |",
              flush=True)
        if not publishing and drain_until is None:
            drain_until = now + args.drain_s  # the last messages have been sent: let the worker finish
        if drain_until is not None and (len(reader.finals) == args.ranks or now >= drain_until):
            return


def _interrupt(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals the process and then its group: once is enough
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker", choices=["tansu", "kafka"], default="tansu")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--metrics", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--format", choices=["json", "binary"], default="binary", help="the ranks' wire format")
    ap.add_argument("--shape", choices=SHAPES, default="flat",
                    help="training: the loss and grad norm fall as in a real run (rankwatch.sim)")
    ap.add_argument("--every-s", type=float, default=30.0, help="seconds between rows")
    ap.add_argument("--warmup-min", type=float, default=2.0, help="minutes left out of the RSS growth and max lag")
    ap.add_argument("--drain-s", type=float, default=900.0,
                    help="how long to wait after the last tick for every rank's last message to be applied")
    ap.add_argument("--store", action="store_true", help="run the report store's sink as well")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    out = soak(args)
    growth = 100 * (out["rss_last"] - out["rss_first"]) / out["rss_first"]
    kinds = sorted({f"{a['detector']}:{a['metric']}" for a in out["alerts"]})
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; after {args.warmup_min:g} min of warm-up:")
    print("| ranks | minutes | broker | workers | RSS MB first → last | RSS growth | max lag s "
          "| done after last tick s | ranks final | alerts |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.ranks} | {args.minutes:g} | {args.broker} | {args.workers} | {out['rss_first']:.0f} → "
          f"{out['rss_last']:.0f} | {growth:+.1f}% | {out['lag_max']:.1f} | {out['behind_at_end_s']:.0f} "
          f"| {out['finals']}/{args.ranks} | {len(out['alerts'])}{' (' + ', '.join(kinds) + ')' if kinds else ''} |")


if __name__ == "__main__":
    main()
