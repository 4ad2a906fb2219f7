"""What telemetry costs a training rank: rankwatch's ``log()`` and ``TrainerHook`` next to what users
would use instead, in the same process and run.

1. One call on the training thread, timed call by call (median, p99): ``RankPublisher.log`` of 4
   values (floats, and 0-d tensors), ``wandb.log`` of the same 4 values in offline mode, and
   TensorBoard's ``SummaryWriter.add_scalar`` x 4. A little tensor work runs between calls, as a
   training step would, so rankwatch's sender thread runs concurrently, as it does in training.
2. Wire encodings of a telemetry batch: encode/decode time and bytes per value.
3. Bounded memory: a publisher whose broker is down, flooded; the queue bound and the drop count.

What the hook costs a whole training step is ``bench/step_cost.py``'s question.

wandb and tensorboard are not rankwatch dependencies: ``pip install wandb tensorboard`` to include
them (the table says when one is missing). Nothing is asserted; it prints tables.

    python bench/log_cost.py [--calls 20000] [--sections 123]
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import logging
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from rankwatch.producers import RankPublisher
from rankwatch.producers.system import rss_bytes
from rankwatch.broker import free_port
from rankwatch.contract import Series, TelemetryBatch

VALUES = {"loss": 0.5, "grad_norm": 1.25, "lr": 3e-4, "tokens_per_s": 12_345.0}


def _work(a: torch.Tensor) -> None:
    """A few microseconds of tensor work between calls, like the rest of a training step."""
    a.mul_(0.999).add_(0.001)


def time_calls(call, n: int) -> np.ndarray:
    """Microseconds of each of ``n`` calls of ``call(i)``, timed one by one."""
    a = torch.ones(4096)
    out = np.empty(n)
    clock = time.perf_counter_ns
    for i in range(n):
        _work(a)
        t0 = clock()
        call(i)
        out[i] = clock() - t0
    return out / 1e3


def section_calls(calls: int) -> None:
    print(f"\n## 1. One call on the training thread ({calls} calls each, µs)\n")
    rows: list[tuple[str, np.ndarray | None, str]] = []
    timer = time_calls(lambda i: None, calls)
    rows.append(("(the timer alone)", timer, ""))

    pub = RankPublisher(run="bench", rank=0, world_size=1, bootstrap=f"127.0.0.1:{free_port()}",
                        connect_timeout_s=0.5, max_queue=10 * calls, drain_s=0)
    rows.append(("rankwatch log(), 4 floats", time_calls(lambda i: pub.log(VALUES, i), calls), ""))
    tensors = {k: torch.tensor(v) for k, v in VALUES.items()}
    rows.append(("rankwatch log(), 4 0-d tensors", time_calls(lambda i: pub.log(tensors, i), calls), ""))
    pub.close(timeout_s=2)

    with tempfile.TemporaryDirectory() as tmp:
        try:
            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
            import wandb

            run = wandb.init(project="rankwatch-bench", dir=tmp, mode="offline")
            rows.append(("wandb.log, 4 values (offline)", time_calls(lambda i: wandb.log(VALUES, step=i), calls), ""))
            run.finish()
        except ImportError:
            rows.append(("wandb.log, 4 values (offline)", None, "not installed: pip install wandb"))
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=tmp)

            def tb(i: int) -> None:
                for name, value in VALUES.items():
                    writer.add_scalar(name, value, i)

            rows.append(("tensorboard add_scalar x 4", time_calls(tb, calls), ""))
            writer.close()
        except ImportError:
            rows.append(("tensorboard add_scalar x 4", None, "not installed: pip install tensorboard"))

    base = float(np.median(rows[1][1]))
    print(f"| {'what':32} | {'median':>8} | {'p99':>8} | {'mean':>8} | {'median vs rankwatch':>20} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 22}|")
    for name, t, note in rows:
        if t is None:
            print(f"| {name:32} | {note:>65} |")
            continue
        med, p99, mean = np.median(t), np.percentile(t, 99), t.mean()
        ratio = f"{med / base:.1f}x" if name.startswith(("wandb", "tensorboard")) else ""
        print(f"| {name:32} | {med:8.2f} | {p99:8.2f} | {mean:8.2f} | {ratio:>20} |")


def _batch(metrics: int, steps: int) -> TelemetryBatch:
    rng = np.random.default_rng(0)
    series = {f"metric_{m}": Series(np.arange(1000, 1000 + steps), rng.lognormal(size=steps)) for m in range(metrics)}
    return TelemetryBatch(run="bench-run", rank=3, world_size=8, producer="host:3:1234:abcdef12", seq=7,
                          ts=time.time(), series=series)


def _encoders():
    out = {}

    def json_b64_encode(b: TelemetryBatch) -> bytes:
        series = {n: {"steps": base64.b64encode(s.steps.astype("<i8").tobytes()).decode(),
                      "values": base64.b64encode(s.values.astype("<f8").tobytes()).decode()}
                  for n, s in b.series.items()}
        return json.dumps({"schema": 1, "kind": "telemetry", "run": b.run, "rank": b.rank, "series": series},
                          separators=(",", ":")).encode()

    def json_b64_decode(data: bytes) -> dict:
        obj = json.loads(data)
        return {n: (np.frombuffer(base64.b64decode(s["steps"]), "<i8"), np.frombuffer(base64.b64decode(s["values"]), "<f8"))
                for n, s in obj["series"].items()}

    out["JSON (the contract today)"] = (lambda b: b.to_bytes(), TelemetryBatch.from_bytes)
    out["JSON, base64 float64 arrays"] = (json_b64_encode, json_b64_decode)
    try:
        import msgpack

        def mp_encode(b: TelemetryBatch) -> bytes:
            return msgpack.packb({"schema": 1, "kind": "telemetry", "run": b.run, "rank": b.rank,
                                  "series": {n: {"steps": s.steps.tolist(), "values": s.values.tolist()}
                                             for n, s in b.series.items()}})

        def mp_decode(data: bytes) -> dict:
            obj = msgpack.unpackb(data)
            return {n: (np.asarray(s["steps"], np.int64), np.asarray(s["values"], np.float64))
                    for n, s in obj["series"].items()}

        def mp_raw_encode(b: TelemetryBatch) -> bytes:
            return msgpack.packb({"schema": 1, "kind": "telemetry", "run": b.run, "rank": b.rank,
                                  "series": {n: [s.steps.astype("<i8").tobytes(), s.values.astype("<f8").tobytes()]
                                             for n, s in b.series.items()}})

        def mp_raw_decode(data: bytes) -> dict:
            obj = msgpack.unpackb(data)
            return {n: (np.frombuffer(st, "<i8"), np.frombuffer(v, "<f8")) for n, (st, v) in obj["series"].items()}

        out["msgpack, lists"] = (mp_encode, mp_decode)
        out["msgpack, raw float64 arrays"] = (mp_raw_encode, mp_raw_decode)
    except ImportError:
        out["msgpack (not installed: pip install msgpack)"] = None
    return out


def section_encoding() -> None:
    print("\n## 2. Encoding a telemetry batch (per value: µs to encode, µs to decode, bytes; zlib-6 bytes)\n")
    shapes = ((16, 1, "one step of 16 metrics (a heartbeat, or one step per message)"),
              (16, 64, "64 steps of 16 metrics (a batch under load)"))
    for metrics, steps, label in shapes:
        batch, n = _batch(metrics, steps), metrics * steps
        print(f"{label}:\n")
        print("| encoding | encode µs/value | decode µs/value | bytes/value | compressed bytes/value |")
        print("|---|---|---|---|---|")
        for name, codec in _encoders().items():
            if codec is None:
                print(f"| {name} | | | | |")
                continue
            encode, decode = codec
            data = encode(batch)
            reps = max(3, 20_000 // n)
            t0 = time.perf_counter()
            for _ in range(reps):
                encode(batch)
            t_enc = (time.perf_counter() - t0) / reps / n * 1e6
            t0 = time.perf_counter()
            for _ in range(reps):
                decode(data)
            t_dec = (time.perf_counter() - t0) / reps / n * 1e6
            print(f"| {name} | {t_enc:.3f} | {t_dec:.3f} | {len(data) / n:.1f} | {len(zlib.compress(data, 6)) / n:.1f} |")
        print()


def section_memory() -> None:
    print("## 3. Bounded memory and disk: the broker is down and the training thread floods log() for 5 s\n")
    gc.collect()
    before = rss_bytes() or 0.0
    spool_bound = 512 << 10
    with tempfile.TemporaryDirectory() as tmp:
        pub = RankPublisher(run="bench-down", rank=0, world_size=1, bootstrap=f"127.0.0.1:{free_port()}",
                            connect_timeout_s=0.5, max_queue=10_000, linger_s=0.5, spool_dir=tmp,
                            max_spool_bytes=spool_bound, drain_s=0)
        metrics = {f"m{i}": float(i) for i in range(8)}
        started, calls = time.perf_counter(), 0
        while time.perf_counter() - started < 5.0:  # long enough for the sender to fill the spool too
            for _ in range(1000):
                pub.log(metrics, calls)
                calls += 1
        elapsed = time.perf_counter() - started
        queued = pub.stats().queued
        time.sleep(3.0)  # the sender spools what it took; the queue's overflow is gone already
        stats = pub.stats()
        after = rss_bytes() or 0.0
        on_disk = sum(f.stat().st_size for f in Path(pub.spool).glob("*.seg"))
        pub.close(timeout_s=2)
    print("| log() calls | max_queue | queued after the calls | max_spool_bytes | spool on disk "
          "| dropped (counted, logged) | RSS growth | µs per call |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {calls:,} | 10,000 | {queued:,} | {spool_bound / 2**10:.0f} KiB | {on_disk / 2**10:.0f} KiB "
          f"| {stats.dropped:,} | {(after - before) / 2**20:.1f} MiB | {elapsed / calls * 1e6:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000, help="section 1: calls timed per logger (default 20000)")
    ap.add_argument("--sections", default="123", help="which sections to run, e.g. 1 or 23 (default 123)")
    args = ap.parse_args(argv)
    if not args.sections or set(args.sections) - set("123"):
        ap.error(f"--sections takes digits 1 to 3, got {args.sections!r}")
    # The offline publishers' "broker unreachable" and "queue full" warnings; the tables count them.
    logging.getLogger("producers").setLevel(logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads 1, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "1" in args.sections:
        section_calls(args.calls)
    if "2" in args.sections:
        section_encoding()
    if "3" in args.sections:
        section_memory()


if __name__ == "__main__":
    main()
