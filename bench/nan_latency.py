"""NaN-to-alert latency: from the moment a rank's telemetry batch with a NaN is sent to the moment
the alert is readable on ``rankwatch.alerts``, with many ranks publishing at once.

Simulated ranks (one producer process sends a batch per rank per step, as ranks with one batch per
step would) publish loss, grad_norm and step_time_s. Every few steps one random rank's loss is NaN;
a plain kafka-python consumer timestamps each alert. One worker, the embedded broker (or
``--bootstrap``). Prints a table; nothing here is asserted.

    python bench/nan_latency.py --ranks 64 256 1024 --trials 20
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert, Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.stack import Stack


def measure(bootstrap: str, ranks: int, trials: int, step_s: float, gap_steps: int) -> dict:
    run = f"bench-{ranks}-{int(time.time())}"
    sent_at: dict[int, float] = {}  # NaN step -> send time
    seen_at: dict[int, float] = {}
    stop = threading.Event()

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
    lat = np.array([seen_at[s] - sent_at[s] for s in sent_at if s in seen_at]) * 1000
    return {
        "ranks": ranks, "msgs/s": messages / elapsed, "trials": len(sent_at), "alerted": len(lat),
        "p50_ms": np.percentile(lat, 50) if len(lat) else float("nan"),
        "p99_ms": np.percentile(lat, 99) if len(lat) else float("nan"),
        "max_ms": lat.max() if len(lat) else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--step-s", type=float, default=0.5, help="seconds per training step (default 0.5)")
    ap.add_argument("--gap-steps", type=int, default=12, help="steps between injected NaNs (resolve + cooldown)")
    ap.add_argument("--bootstrap", help="use this broker and its running workers instead of starting both")
    args = ap.parse_args()

    rows = []
    if args.bootstrap:
        rows = [measure(args.bootstrap, n, args.trials, args.step_s, args.gap_steps) for n in args.ranks]
    else:
        settings = Settings(data_dir=f"/tmp/rankwatch-bench-{time.time_ns()}")
        with Stack(settings, embedded=True, port=free_port()) as stack:
            for n in args.ranks:
                print(f"measuring {n} ranks …", flush=True)
                rows.append(measure(stack.bootstrap, n, args.trials, args.step_s, args.gap_steps))
    print(f"\nNaN-to-alert latency, 1 worker, step every {args.step_s}s, one batch per rank per step")
    print(f"{'ranks':>6} {'msgs/s':>8} {'NaNs':>5} {'alerted':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['msgs/s']:>8.0f} {r['trials']:>5} {r['alerted']:>8} "
              f"{r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['max_ms']:>8.0f}")


if __name__ == "__main__":
    main()
