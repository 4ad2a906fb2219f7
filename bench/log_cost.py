"""What telemetry costs a training rank: rankwatch's ``log()`` and ``TrainerHook`` next to what users
would use instead, in the same process and run.

1. One call on the training thread, timed call by call (median, p99): ``RankPublisher.log`` of 4
   values (floats, and 0-d tensors), ``wandb.log`` of the same 4 values in offline mode, and
   TensorBoard's ``SummaryWriter.add_scalar`` x 4. A little tensor work runs between calls, as a
   training step would, so rankwatch's sender thread runs concurrently, as it does in training.
2. A small CPU training step with and without ``TrainerHook``, blocks interleaved, publishing to a
   real embedded broker; the overhead is the median of the per-block ratios, with a bootstrap 95%
   interval and an A/A comparison (no hook vs no hook) as the noise floor.
3. Wire encodings of a telemetry batch: encode/decode time and bytes per value.
4. Bounded memory: a publisher whose broker is down, flooded; the queue bound and the drop count.

wandb and tensorboard are not rankwatch dependencies: ``pip install wandb tensorboard`` to include
them (the table says when one is missing). Nothing is asserted; it prints tables.

    python bench/log_cost.py [--calls 20000] [--blocks 15] [--bootstrap HOST:PORT]
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

import numpy as np
import torch

from producers import RankPublisher, TrainerHook
from producers.system import rss_bytes
from rankwatch.broker import EmbeddedBroker, free_port
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
                        connect_timeout_s=0.5, max_queue=10 * calls)
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


def _model(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "tiny":  # ~4k parameters: a fraction of a millisecond per step
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        x, y = torch.randn(32, 32, generator=g), torch.randint(10, (32,), generator=g)
    else:  # ~1.6M parameters: a few milliseconds per step
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        x, y = torch.randn(64, 256, generator=g), torch.randint(10, (64,), generator=g)
    return model, x, y


def _block(model, opt, pub, x, y, steps: int, hooked: bool) -> float:
    """Seconds per step over ``steps`` steps, with a fresh hook (publishing to ``pub``) or none."""
    hook = TrainerHook(model, opt, pub, samples_per_step=len(x)) if hooked else None
    started = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if hook is not None:
            hook.set_loss(loss)
        opt.step()
    elapsed = (time.perf_counter() - started) / steps
    if hook is not None:
        hook.detach()
    return elapsed


class _Discard:
    """A publisher that drops everything: what is left is the hook's cost on the training thread."""

    def log(self, metrics, step) -> None:
        pass

    def add_sampler(self, sampler) -> None:
        pass


def _interval(ratios: np.ndarray) -> str:
    boot = np.median(np.random.default_rng(0).choice(ratios, (2000, len(ratios))), axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return f"{np.median(ratios):+.2%} [{lo:+.2%}, {hi:+.2%}]"


def section_step(bootstrap: str, blocks: int) -> None:
    print(f"\n## 2. A CPU training step with and without TrainerHook ({blocks} interleaved blocks)\n")
    print("Median of per-block ratios to the plain step, [bootstrap 95% interval]. 'hook + broker': the hook,")
    print("publishing to the embedded broker, which runs on the same cores; 'hook, nothing sent': the")
    print("training-thread cost alone (a publisher that drops every point); A/A: plain vs plain, the noise.\n")
    print("| model | params | plain step (ms) | hook + broker | hook, nothing sent | A/A |")
    print("|---|---|---|---|---|---|")
    for kind, steps in (("tiny", 400), ("small", 30)):
        model, x, y = _model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        live = RankPublisher(run=f"bench-{kind}-{int(time.time())}", rank=0, world_size=1, bootstrap=bootstrap)
        configs = {"plain": None, "live": live, "idle": _Discard(), "plain again": None}
        times: dict[str, list[float]] = {name: [] for name in configs}
        for pub in configs.values():  # warm-up: allocator, connection, first batches
            _block(model, opt, pub, x, y, steps, pub is not None)
        names = list(configs)
        for i in range(blocks):
            for name in names[i % 4:] + names[:i % 4]:  # rotated, so no configuration always goes first
                pub = configs[name]
                gc.collect()  # each block starts without the previous one's garbage
                times[name].append(_block(model, opt, pub, x, y, steps, pub is not None))
        live.close()
        plain = np.array(times["plain"])
        params = sum(p.numel() for p in model.parameters())
        cells = [_interval(np.array(times[name]) / plain - 1) for name in ("live", "idle", "plain again")]
        print(f"| {kind} | {params:,} | {np.median(plain) * 1e3:.3f} | " + " | ".join(cells) + " |")
        assert live.stats().failed == 0, live.stats()


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
    print("\n## 3. Encoding a telemetry batch (per value: µs to encode, µs to decode, bytes; zlib-6 bytes)\n")
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
    print("## 4. Bounded memory: the broker is down and the training thread floods log()\n")
    gc.collect()
    before = rss_bytes() or 0.0
    pub = RankPublisher(run="bench-down", rank=0, world_size=1, bootstrap=f"127.0.0.1:{free_port()}",
                        connect_timeout_s=0.5, max_queue=10_000, linger_s=0.5)
    metrics = {f"m{i}": float(i) for i in range(8)}
    started = time.perf_counter()
    for step in range(300_000):
        pub.log(metrics, step)
    elapsed = time.perf_counter() - started
    stats = pub.stats()
    after = rss_bytes() or 0.0
    pub.close(timeout_s=2)
    print("| log() calls | max_queue | queued at the end | dropped (counted, logged) | RSS growth | µs per call |")
    print("|---|---|---|---|---|---|")
    print(f"| 300,000 | 10,000 | {stats.queued:,} | {stats.dropped:,} | {(after - before) / 2**20:.1f} MiB "
          f"| {elapsed / 300_000 * 1e6:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000, help="calls timed per logger (default 20000)")
    ap.add_argument("--blocks", type=int, default=15, help="interleaved blocks per model (default 15)")
    ap.add_argument("--bootstrap", help="a running broker; default: start the embedded one")
    args = ap.parse_args(argv)
    # The offline publishers' "broker unreachable" and "queue full" warnings; the tables count them.
    logging.getLogger("producers").setLevel(logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads 1")
    section_calls(args.calls)
    if args.bootstrap:
        section_step(args.bootstrap, args.blocks)
    else:
        with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(port=free_port(), log_path=f"{tmp}/broker.log") as broker:
            section_step(broker.bootstrap, args.blocks)
    section_encoding()
    section_memory()


if __name__ == "__main__":
    main()
