"""Telemetry wire formats: encode and decode speed (M values/s) and size (bytes/value), JSON vs binary.

Each message is one rank's batch of ``--steps`` steps × ``--metrics`` metrics (default 64 × 16, the
shape of issue 16's preloaded topic), values drawn as a training loss would be, with one NaN per
message so the non-finite path is part of what is timed. Encode is ``TelemetryBatch.to_bytes``
(``binary=True`` for the binary form), decode is ``TelemetryBatch.from_bytes``: the contract's own
functions, the ones the publisher and the worker call. The row "binary, envelope by ormsgpack" swaps
only the msgpack library (same layout, same checks) to show what the choice of library is worth.
No broker, no I/O: the CPU cost of the format alone. Each figure is the best of ``--repeat`` runs
(the machine is shared: the best run is the one least disturbed).

    .venv/bin/python bench/wire_format.py [--messages 2000] [--steps 64] [--metrics 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from rankwatch.contract import Series, TelemetryBatch
from rankwatch.contract import binary as binary_module


def make_batches(n: int, steps: int, metrics: int, seed: int = 0) -> list[TelemetryBatch]:
    rng = np.random.default_rng(seed)
    names = [f"metric_{i:02d}/train" for i in range(metrics)]
    out = []
    for m in range(n):
        first = 1_000 + m * steps
        step_range = np.arange(first, first + steps, dtype=np.int64)
        series = {}
        for i, name in enumerate(names):
            values = 2.0 * np.exp(-step_range / 5e4) + rng.normal(0, 0.05, steps)
            if i == m % metrics:
                values[m % steps] = np.nan
            series[name] = Series(steps=step_range, values=values)
        out.append(TelemetryBatch(run="bench-run", rank=m % 1024, world_size=1024,
                                  producer="host-17:3:41234:9f2c1a7b", seq=m, ts=1.7e9 + m, series=series))
    return out


def best_rate(work, items, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            work(item)
        best = min(best, time.perf_counter() - start)
    return best


def measure(batches, encode, decode, repeat: int) -> tuple[float, float, float]:
    values = sum(len(s.values) for b in batches for s in b.series.values())
    data = [encode(b) for b in batches]
    enc = best_rate(encode, batches, repeat)
    dec = best_rate(decode, data, repeat)
    return values / enc / 1e6, values / dec / 1e6, sum(map(len, data)) / values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--metrics", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    batches = make_batches(args.messages, args.steps, args.metrics)
    rows = {
        "JSON (schema 1)": measure(batches, TelemetryBatch.to_bytes, TelemetryBatch.from_bytes, args.repeat),
        "binary (schema 2, msgpack)": measure(batches, lambda b: b.to_bytes(binary=True), TelemetryBatch.from_bytes,
                                              args.repeat),
    }
    try:
        import ormsgpack
    except ImportError:
        ormsgpack = None
    if ormsgpack is not None:
        # Same layout and checks; only the library that packs and unpacks the map differs.
        real = binary_module.msgpack
        binary_module.msgpack = SimpleNamespace(packb=lambda obj, use_bin_type: ormsgpack.packb(obj),
                                                unpackb=lambda data, raw, strict_map_key: ormsgpack.unpackb(data),
                                                UnpackException=real.UnpackException)
        try:
            rows["binary, envelope by ormsgpack"] = measure(
                batches, lambda b: b.to_bytes(binary=True), TelemetryBatch.from_bytes, args.repeat)
        finally:
            binary_module.msgpack = real
    print(f"{args.messages} messages × {args.steps} steps × {args.metrics} metrics, best of {args.repeat}\n")
    print("| format | encode M values/s | decode M values/s | bytes/value |")
    print("|---|---|---|---|")
    for name, (enc, dec, size) in rows.items():
        print(f"| {name} | {enc:.2f} | {dec:.2f} | {size:.2f} |")
    json_row, bin_row = rows["JSON (schema 1)"], rows["binary (schema 2, msgpack)"]
    print(f"\nbinary vs JSON: encode ×{bin_row[0] / json_row[0]:.0f}, decode ×{bin_row[1] / json_row[1]:.0f}, "
          f"size ×{bin_row[2] / json_row[2]:.2f}")


if __name__ == "__main__":
    main()
