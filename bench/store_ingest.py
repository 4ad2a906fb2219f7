"""What the report store's sink pays when a whole run closes a rollup window at once (issue 16).

At 1 Hz every rank of a run closes its window at the same step, so the sink reads N ranks x M metrics
rollups in a burst, ``max_records`` a poll. Each poll's rows are written in one transaction; the
run-wide row of each window (its ranks merged: moments and t-digests) is recomputed either with every
write ("every poll", what the store did before) or once the burst is read, as the sink now does at
most every ``MERGE_EVERY_S`` (2 s; a burst is read in less). Rollups carry a 50-point sketch, as the workers send them; SQLite in a temporary directory.
Prints a table; asserts nothing.

    python bench/store_ingest.py --ranks 128 1024 --metrics 32
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from rankwatch.contract import REPORTS, Rollup
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_query import Filters, Queries
from rankwatch.sketch import Sketch


def burst(ranks: int, metrics: int, width: int, seed: int = 0) -> list[tuple[str, int, int, bytes]]:
    """One window of every rank and metric, as records in the order a consumer might get them."""
    rng = np.random.default_rng(seed)
    out = []
    for rank in range(ranks):
        for m in range(metrics):
            v = rng.normal(size=width)
            r = Rollup(run="bench", rank=rank, metric=f"m{m}", start_step=0, end_step=width, count=width,
                       nonfinite=0, mean=float(v.mean()), std=float(v.std(ddof=1)), min=float(v.min()),
                       max=float(v.max()), last=float(v[-1]), ts=time.time(), world_size=ranks,
                       sketch=Sketch.of(v.tolist()).to_wire())
            out.append((REPORTS, rank % 8, len(out), r.to_bytes()))
    rng.shuffle(out)
    return out


def ingest(records: list, poll: int, merge_each_poll: bool) -> tuple[float, float, int]:
    """CPU and wall seconds to store ``records`` ``poll`` at a time; the run-wide rows stored."""
    with tempfile.TemporaryDirectory() as folder:
        store = ReportStore(str(Path(folder) / "store.db"))
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(0, len(records), poll):
            store.write(records[i : i + poll], merge=merge_each_poll)
        store.merge()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        merged = len(Queries(store.db).rollups("bench", Filters(rank="all")))
        store.close()
    return cpu, wall, merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--metrics", type=int, default=32)
    parser.add_argument("--width", type=int, default=50, help="points per window (Settings.rollup_steps)")
    parser.add_argument("--poll", type=int, default=2000, help="records per poll (the sink's max_records)")
    args = parser.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{len(os.sched_getaffinity(0))} CPUs; one window of every rank and metric, "
          f"{args.metrics} metrics, polls of {args.poll}, SQLite")
    print("| ranks | rollups | merged | CPU s, merged every poll | CPU s, merged once read | wall s, every poll | wall s, once |")
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        records = burst(ranks, args.metrics, args.width)
        each_cpu, each_wall, merged = ingest(records, args.poll, True)
        once_cpu, once_wall, merged_once = ingest(records, args.poll, False)
        assert merged == merged_once == args.metrics, (merged, merged_once)
        print(f"| {ranks:,} | {len(records):,} | {merged} | {each_cpu:.2f} | {once_cpu:.2f} | {each_wall:.2f} | "
              f"{once_wall:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
