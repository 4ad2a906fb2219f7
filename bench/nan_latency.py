"""NaN-to-alert latency: from the moment a rank's telemetry batch with a NaN is sent to the moment
the alert is readable on ``rankwatch.alerts``, with many ranks publishing at once.

Simulated ranks (one producer process sends a batch per rank per step, as ranks with one batch per
step would) publish loss, grad_norm and step_time_s. Every few steps one random rank's loss is NaN;
a plain kafka-python consumer timestamps each alert. One worker, the embedded broker (or
``--bootstrap``). Prints a table; nothing here is asserted.

Then the same through the real publishing path, from the ``log()`` call to the alert: ``RankPublisher``
instances (each with its sender thread, spool and shipper process) for a few ranks, with the NaN
on one rank (its peers' points wait up to ``linger_s`` and the alert waits for them to report the
step, or ``group_wait_s``) and on every rank at once (as in DDP, where the NaN crosses the all-reduce).

    python bench/nan_latency.py --ranks 64 256 1024 --trials 20 [--publishers 8]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rankwatch.producers import RankPublisher
from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert, Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.stack import Stack

from scratch import scratch_dir


def _watch(bootstrap: str, run: str, seen_at: dict[int, float], stop: threading.Event) -> threading.Thread:
    """A thread that notes when each firing nonfinite alert of ``run`` is readable (incident: its step)."""

    def watch() -> None:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, fetch_max_wait_ms=10, enable_auto_commit=False)
        tps = [TopicPartition(contract.ALERTS, p) for p in consumer.partitions_for_topic(contract.ALERTS)]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=20).values():
                now = time.time()
                for r in records:
                    a = Alert.from_bytes(r.value)
                    if a.run == run and a.detector == "nonfinite" and a.status == "firing":
                        seen_at.setdefault(a.incident, now)
        consumer.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(1.0)
    return watcher


def _row(ranks: int, messages: float, sent_at: dict[int, float], seen_at: dict[int, float]) -> dict:
    lat = np.array([seen_at[s] - sent_at[s] for s in sent_at if s in seen_at]) * 1000
    return {
        "ranks": ranks, "msgs/s": messages, "trials": len(sent_at), "alerted": len(lat),
        "p50_ms": np.percentile(lat, 50) if len(lat) else float("nan"),
        "p99_ms": np.percentile(lat, 99) if len(lat) else float("nan"),
        "max_ms": lat.max() if len(lat) else float("nan"),
    }


def measure_publishers(bootstrap: str, ranks: int, trials: int, step_s: float, gap_steps: int, *,
                       everywhere: bool) -> dict:
    """From the NaN's ``log()`` to the alert, through real publishers (NaN on one rank, or on all)."""
    run = f"bench-pub-{ranks}-{'all' if everywhere else 'one'}-{int(time.time())}"
    sent_at: dict[int, float] = {}
    seen_at: dict[int, float] = {}
    stop = threading.Event()
    watcher = _watch(bootstrap, run, seen_at, stop)
    publishers = [RankPublisher(run=run, rank=r, world_size=ranks, bootstrap=bootstrap, samplers=[])
                  for r in range(ranks)]
    rng = np.random.default_rng(1)
    total_steps = 30 + trials * gap_steps
    nan_steps = {30 + i * gap_steps: int(rng.integers(ranks)) for i in range(trials)}
    started = time.perf_counter()
    for step in range(total_steps):
        delay = started + step * step_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        nan_rank = nan_steps.get(step)
        if nan_rank is not None:
            sent_at[step] = time.time()
        for r, publisher in enumerate(publishers):
            nan = nan_rank is not None and (everywhere or r == nan_rank)
            publisher.log({"loss": float("nan") if nan else 2.0 + 0.01 * rng.standard_normal(),
                           "grad_norm": 1.0 + 0.01 * rng.standard_normal(), "step_time_s": step_s}, step)
    for publisher in publishers:
        publisher.close()
    time.sleep(3.0)
    stop.set()
    watcher.join()
    sent = sum(p.stats().sent for p in publishers)
    return _row(ranks, sent / (time.perf_counter() - started), sent_at, seen_at)


def measure(bootstrap: str, ranks: int, trials: int, step_s: float, gap_steps: int) -> dict:
    run = f"bench-{ranks}-{int(time.time())}"
    sent_at: dict[int, float] = {}  # NaN step -> send time
    seen_at: dict[int, float] = {}
    stop = threading.Event()

    watcher = _watch(bootstrap, run, seen_at, stop)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, batch_size=1 << 20)
    rng = np.random.default_rng(0)
    total_steps = 30 + trials * gap_steps
    nan_steps = {30 + i * gap_steps: int(rng.integers(ranks)) for i in range(trials)}
    started = time.perf_counter()
    messages = 0
    for step in range(total_steps):
        tick = started + step * step_s
        delay = tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        nan_rank = nan_steps.get(step)
        order = list(range(ranks))
        random.shuffle(order)  # ranks finish a step in no particular order
        if nan_rank is not None:
            sent_at[step] = time.time()
        for r in order:
            loss = float("nan") if r == nan_rank else 2.0 + 0.01 * rng.standard_normal()
            batch = TelemetryBatch(
                run=run, rank=r, world_size=ranks, producer="bench", seq=step, ts=time.time(),
                final=step == total_steps - 1,  # as RankPublisher.close() does: the end is no stall
                series={"loss": Series(np.array([step]), np.array([loss])),
                        "grad_norm": Series(np.array([step]), np.array([1.0 + 0.01 * rng.standard_normal()])),
                        "step_time_s": Series(np.array([step]), np.array([step_s]))},
            )
            producer.send(contract.TELEMETRY, batch.to_bytes(), key=batch.key)
            messages += 1
        producer.flush()
    elapsed = time.perf_counter() - started
    time.sleep(3.0)
    stop.set()
    watcher.join()
    producer.close()
    return _row(ranks, messages / elapsed, sent_at, seen_at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--step-s", type=float, default=0.5, help="seconds per training step (default 0.5)")
    ap.add_argument("--gap-steps", type=int, default=12, help="steps between injected NaNs (resolve + cooldown)")
    ap.add_argument("--publishers", type=int, default=8,
                    help="ranks for the log()-to-alert measurement through real publishers (0: skip it; default 8)")
    ap.add_argument("--bootstrap", help="use this broker and its running workers instead of starting both")
    args = ap.parse_args()

    def run_all(bootstrap: str) -> tuple[list[dict], list[tuple[str, dict]]]:
        raw = []
        for n in args.ranks:
            print(f"measuring {n} simulated ranks …", flush=True)
            raw.append(measure(bootstrap, n, args.trials, args.step_s, args.gap_steps))
        real = []
        for everywhere in (False, True) if args.publishers else ():
            print(f"measuring {args.publishers} publishers, NaN on {'every rank' if everywhere else 'one rank'} …",
                  flush=True)
            real.append(("every rank" if everywhere else "one rank", measure_publishers(
                bootstrap, args.publishers, args.trials, args.step_s, args.gap_steps, everywhere=everywhere)))
        return raw, real

    if args.bootstrap:
        rows, real = run_all(args.bootstrap)
    else:
        settings = Settings(data_dir=scratch_dir("nan-latency"))
        with Stack(settings, embedded=True, port=free_port()) as stack:
            rows, real = run_all(stack.bootstrap)
    print(f"\nNaN-to-alert latency, 1 worker, step every {args.step_s}s, one batch per rank per step")
    print("| ranks | msgs/s | NaNs | alerted | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['msgs/s']:.0f} | {r['trials']} | {r['alerted']} "
              f"| {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} |")
    if real:
        print("\nFrom log() to the alert, through RankPublisher (sender thread, spool, shipper process)")
        print("| ranks | NaN on | msgs/s | NaNs | alerted | p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|---|---|---|")
        for where, r in real:
            print(f"| {r['ranks']} | {where} | {r['msgs/s']:.0f} | {r['trials']} | {r['alerted']} "
                  f"| {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} |")


if __name__ == "__main__":
    main()
