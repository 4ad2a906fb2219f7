"""Query latency of ``rankwatch serve`` on a report store of 1 M rollups (SQLite by default).

Builds the store (per-rank rows written as the sink writes them, plus the run-wide rows), starts the
real HTTP server on loopback, and times each kind of request end to end. Prints a table.

    .venv/bin/python bench/store_query.py [--rollups 1000000] [--requests 200] [--scrapes 20] [--store URL]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import urllib.request

import numpy as np
from prometheus_client import CollectorRegistry

from rankwatch.sinks import store_rollups
from rankwatch.sinks.api import ReportAPI, make_server
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_schema import ALL_RANKS

RUNS, RANKS, METRICS, WIDTH = 10, 8, 10, 50


def build(url: str, n_rollups: int) -> None:
    store = ReportStore(url)
    windows = n_rollups // (RUNS * RANKS * METRICS)
    sql = store.db.dialect.sql(store_rollups.upsert_sql())
    rng = np.random.default_rng(0)
    sketch = json.dumps({"means": sorted(rng.normal(size=50).round(4).tolist()), "weights": [1.0] * 50})
    t = time.perf_counter()
    for run in range(RUNS):
        rows = []
        for metric in range(METRICS):
            for w in range(windows):
                start = w * WIDTH
                for rank in [*range(RANKS), ALL_RANKS]:
                    rows.append((f"run-{run}", rank, f"metric_{metric}", start, start + WIDTH, start, start + WIDTH - 1,
                                 RANKS, 1 if rank >= 0 else RANKS, WIDTH, 0, 1.0, 0.1, 0.8, 1.2, 1.0, 1.0, 1.15, 1.19,
                                 sketch, time.time()))
        with store.db.transaction() as cur:
            cur.executemany(sql, rows)
            cur.execute(store.db.dialect.sql(
                "INSERT INTO runs (run, first_step, last_step, world_size, first_ts, last_ts) VALUES (?, ?, ?, ?, ?, ?)"),
                (f"run-{run}", 0, windows * WIDTH - 1, RANKS, time.time(), time.time()))
    print(f"built {RUNS * METRICS * windows * (RANKS + 1):,} rollup rows ({RUNS * METRICS * windows * RANKS:,} per-rank) "
          f"in {time.perf_counter() - t:.0f} s")
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollups", type=int, default=1_000_000, help="per-rank rollups to store")
    ap.add_argument("--requests", type=int, default=200, help="requests per query kind")
    ap.add_argument("--scrapes", type=int, default=20, help="requests of /metrics (slower: it reads every run)")
    ap.add_argument("--store", help="store URL (default: a new SQLite file in a temp dir)")
    args = ap.parse_args()
    url = args.store or os.path.join(tempfile.mkdtemp(prefix="rankwatch-bench-"), "store.db")
    build(url, args.rollups)
    server = make_server(ReportAPI(url, registry=CollectorRegistry()), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    windows = args.rollups // (RUNS * RANKS * METRICS)
    queries = {
        "runs": "/runs",
        "metrics of a run": "/runs/run-3/metrics",
        "one metric, one rank, all steps": "/runs/run-3/rollups?metric=metric_4&rank=5",
        "one metric, all ranks, 1k steps": f"/runs/run-3/rollups?metric=metric_4&steps={windows * WIDTH // 2}:"
                                           f"{windows * WIDTH // 2 + 999}",
        "run-wide rows, all metrics": "/runs/run-3/rollups?rank=all&limit=1000",
        "alerts of a run": "/runs/run-3/alerts",
        "/metrics (10 runs, 64 ranks max)": "/metrics",
    }
    print(f"{'query':36} {'rows':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, path in queries.items():
        times = []
        for _ in range(args.scrapes if path == "/metrics" else args.requests):
            t = time.perf_counter()
            with urllib.request.urlopen(base + path) as resp:
                body = resp.read()
            times.append((time.perf_counter() - t) * 1e3)
        rows = len(json.loads(body)) if path != "/metrics" else body.count(b"\n")
        print(f"{name:36} {rows:6d} {np.percentile(times, 50):8.1f} {np.percentile(times, 99):8.1f}")
    server.shutdown()


if __name__ == "__main__":
    main()
