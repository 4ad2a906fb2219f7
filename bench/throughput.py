"""Worker throughput against the cost of just reading the messages (issue 16, goals 1 and 4).

For each worker count: a fresh embedded broker, a telemetry topic preloaded with N simulated ranks
x K messages x (S steps x M metrics) in the documented JSON format (``rankwatch.sim``), then

1. a plain aiokafka consumer reads every message and decodes it into numpy arrays (json, or msgpack
   and ``frombuffer`` with ``--format binary``: the floor any consumer of the format pays), timed in
   the same run;
2. the contract decode alone (``TelemetryBatch.from_bytes`` on the bytes read in 1, no I/O);
3. ``rankwatch worker`` processes (1, 2, 4 … of them, one consumer group): timed from its first
   run event to the last rank's ``final`` progress on ``rankwatch.run_events``, which stage 1
   sends after applying each rank's last message. CPU seconds are the workers' own (from /proc),
   which the load of other jobs on a shared machine disturbs less than wall time.

Prints a table; asserts nothing. The broker, the bench and the workers share the machine's cores.

    python bench/throughput.py --ranks 1024 --messages 10 --steps 64 --metrics 16 --workers 1 2 4

``--profile`` (or ``--profile pyinstrument``, a sampling profiler, if installed) starts no broker: it runs stage 1's per-batch work in this process (the contract decode,
``batching.process_batch`` as the worker calls it, and the rank state's msgpack for the changelog every
``Settings.state_write_s`` messages, as at 1 Hz) on the same simulated messages under cProfile, and prints the
top functions by own and by cumulative time.

    python bench/throughput.py --profile --ranks 32 --messages 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import aiokafka
import msgpack
import numpy as np
from kafka import KafkaConsumer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.sim import SHAPES, QuietRanks, produce
from rankwatch.stack import Stack

from scratch import scratch_dir


def _consumer(bootstrap: str, topic: str) -> tuple[KafkaConsumer, list[TopicPartition]]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=20,
                             max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    return consumer, tps


def plain_read(bootstrap: str, expected: int) -> tuple[float, float, list[bytes]]:
    """Read ``expected`` telemetry messages with aiokafka (Faust's client), json-decode each series
    into numpy; return (wall s, cpu s, the raw values)."""
    return asyncio.run(_plain_read(bootstrap, expected))


async def _plain_read(bootstrap: str, expected: int) -> tuple[float, float, list[bytes]]:
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                         fetch_max_wait_ms=20, max_partition_fetch_bytes=8 << 20)
    await consumer.start()
    tps = [aiokafka.TopicPartition(contract.TELEMETRY, p) for p in consumer.partitions_for_topic(contract.TELEMETRY)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    raw: list[bytes] = []
    values = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while len(raw) < expected:
        for records in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
            for r in records:
                values += _plain_decode(r.value)
                raw.append(r.value)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await consumer.stop()
    return wall, cpu, raw


def _plain_decode(data: bytes) -> int:
    """What any reader of the format pays to get a message's points as numpy arrays; returns their count."""
    if data[:1] == b"\xc1":  # schema 2: msgpack, the points as raw little-endian columns
        obj = msgpack.unpackb(data[1:])
        np.frombuffer(obj["steps"], dtype="<i8")
        return len(np.frombuffer(obj["values"], dtype="<f8"))
    n = 0
    for s in json.loads(data)["series"].values():  # ("NaN" strings would need a slower path)
        np.asarray(s["steps"], dtype=np.int64)
        n += len(np.asarray(s["values"], dtype=np.float64))
    return n


def contract_decode(raw: list[bytes]) -> float:
    started = time.process_time()
    for data in raw:
        TelemetryBatch.from_bytes(data)
    return time.process_time() - started


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_run(stack: Stack, run: str, ranks: int, timeout_s: float) -> tuple[float, float]:
    """Start the stack's workers; (wall s from first run event to the last final, worker CPU s)."""
    consumer, _ = _consumer(stack.bootstrap, contract.RUN_EVENTS)
    stack.start_workers()
    cpu0 = {w.proc.pid: _cpu_s(w.proc.pid) for w in stack.workers}
    finals: set[int] = set()
    first = last = None
    deadline = time.monotonic() + timeout_s
    while len(finals) < ranks and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=100).values():
            now = time.perf_counter()
            for r in records:
                obj = json.loads(r.value)
                if obj.get("run") != run and obj.get("alert", {}).get("run") != run:
                    continue
                first = first or now
                # one rank's progress, or (batched workers) several ranks' in one event
                for item in obj.get("items", [obj]):
                    if item.get("final"):
                        finals.add(item["rank"])
                        last = now
    cpu = sum(_cpu_s(pid) - c for pid, c in cpu0.items())
    consumer.close()
    if len(finals) < ranks or first is None:
        print(f"  worker did not finish within {timeout_s:.0f}s ({len(finals)}/{ranks} ranks final)", flush=True)
        return float("nan"), cpu
    return last - first, cpu


def trial(args, workers: int) -> dict:
    settings = Settings(data_dir=scratch_dir("throughput"), partitions=args.partitions,
                        app_id=f"bench-throughput-{workers}")
    stack = Stack(settings, embedded=True, port=free_port(), workers=workers, ready_timeout_s=120)
    stack.with_store = False
    stack.n_workers = 0  # the broker first; workers once the topic is loaded
    with stack:
        stack.n_workers = workers
        run = f"tp-{time.time_ns()}"
        sim = QuietRanks(run=run, ranks=args.ranks, metrics=args.metrics, steps_per_message=args.steps,
                         binary=args.format == "binary", shape=args.shape)
        print(f"[{workers} worker(s)] preloading {args.ranks * args.messages:,} messages …", flush=True)
        msgs = (m for tick in range(args.messages) for m in sim.messages(tick, final=tick == args.messages - 1))
        sent = produce(stack.bootstrap, msgs)
        values = sent * args.steps * args.metrics
        print(f"[{workers} worker(s)] plain consumer …", flush=True)
        p_wall, p_cpu, raw = plain_read(stack.bootstrap, sent)
        d_cpu = contract_decode(raw)
        del raw
        print(f"[{workers} worker(s)] worker …", flush=True)
        w_wall, w_cpu = worker_run(stack, run, args.ranks, args.timeout_s)
    return {"workers": workers, "values": values, "plain_wall": p_wall, "plain_cpu": p_cpu,
            "decode_cpu": d_cpu, "worker_wall": w_wall, "worker_cpu": w_cpu}


def stage1_work(args):
    """Stage 1's per-batch work on the simulated messages, in this process (no broker, no Faust):
    ``(work, values)``, where ``work()`` runs it once, from fresh state, and returns each tick's CPU
    seconds."""
    from faust.serializers import codecs

    from rankwatch.stream_processors.batching import process_batch
    from rankwatch.stream_processors.processor import TelemetryProcessor
    from rankwatch.stream_processors.tables import STATE_CODEC

    sim = QuietRanks(run="profile", ranks=args.ranks, metrics=args.metrics, steps_per_message=args.steps,
                     binary=args.format == "binary", shape=args.shape)
    raw = [v for tick in range(args.messages) for _, v in sim.messages(tick, final=tick == args.messages - 1)]
    processor = TelemetryProcessor()

    codec = codecs.get_codec(STATE_CODEC)
    state_every = round(Settings().state_write_s)  # ticks between state writes, a tick being a second

    def work() -> list[float]:
        table: dict[str, object] = {}
        ticks = []
        for tick, lo in enumerate(range(0, len(raw), args.ranks)):  # one take: every rank's message of a tick
            started = time.process_time()
            batches = [TelemetryBatch.from_bytes(data) for data in raw[lo : lo + args.ranks]]
            out = process_batch(processor, batches, table.get, time.time())
            table.update(out.states)
            if tick % state_every == 0:  # what the worker writes to the changelog, a tick being a second
                for state in out.states.values():
                    codec.dumps(state)
            ticks.append(time.process_time() - started)
        return ticks

    return work, len(raw) * args.steps * args.metrics


def profile_stage1(args) -> None:
    """Stage 1's per-batch work in-process under cProfile (no broker, no Faust)."""
    import cProfile
    import pstats

    work, values = stage1_work(args)
    cpu = time.process_time()
    ticks = work()
    cpu = time.process_time() - cpu
    print(f"{values:,} values in {cpu:.2f} CPU s: {values / cpu / 1e6:.3f} M values per CPU-second (no profiler)")
    # The detectors warm up over their first 40 points: the second half of a long run is the steady state.
    half = len(ticks) // 2
    for name, part in (("first half of the ticks", ticks[:half]), ("second half", ticks[half:])):
        if part:
            print(f"  {name}: {sum(part) / (len(part) * args.ranks) * 1e6:,.0f} us CPU per message")
    if args.profile == "pyinstrument":  # sampling: no per-call overhead, but wall time
        from pyinstrument import Profiler

        sampler = Profiler(interval=0.0005)
        sampler.start()
        work()
        sampler.stop()
        print(sampler.output_text(unicode=False, color=False, show_all=False))
        return
    profiler = cProfile.Profile(time.process_time)  # CPU time: other jobs on the machine do not count
    cpu = time.process_time()
    profiler.runcall(work)
    cpu = time.process_time() - cpu
    print(f"under cProfile: {cpu:.2f} CPU s")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--messages", type=int, default=10, help="messages per rank")
    ap.add_argument("--steps", type=int, default=64, help="steps per message")
    ap.add_argument("--metrics", type=int, default=16)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--format", choices=["json", "binary"], default="json",
                    help="the simulated ranks' wire format (binary: schema 2, what RankPublisher writes)")
    ap.add_argument("--shape", choices=SHAPES, default="flat",
                    help="training: the loss and grad norm fall as in a real run (rankwatch.sim)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--profile", nargs="?", const="cprofile", choices=["cprofile", "pyinstrument"],
                    help="profile stage 1 in this process, no broker (pyinstrument: if installed)")
    ap.add_argument("--top", type=int, default=25, help="functions the profile lists")
    args = ap.parse_args()
    if args.profile:
        return profile_stage1(args)
    rows = [trial(args, n) for n in args.workers]
    load = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"load {load[0]:.1f}/{load[1]:.1f}; {args.ranks} ranks x {args.messages} messages x "
          f"({args.steps} steps x {args.metrics} metrics), {args.partitions} partitions, {args.shape} series; "
          "M values/s")
    print("| workers | values | plain read+decode (wall) | contract decode (cpu) | worker (wall) | worker (per cpu-s) "
          "| worker/plain (wall) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        plain, worker = r["values"] / r["plain_wall"] / 1e6, r["values"] / r["worker_wall"] / 1e6
        print(f"| {r['workers']} | {r['values'] / 1e6:.2f} M | {plain:.2f} | {r['values'] / r['decode_cpu'] / 1e6:.2f} "
              f"| {worker:.3f} | {r['values'] / r['worker_cpu'] / 1e6:.3f} | {worker / plain:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
