"""Issue 16's five goals in one table: each goal's bench in turn, then target, measured and met or not.

1. throughput: ``throughput.trial`` on the issue's preloaded topic, JSON and binary (worker against a
   plain read + decode of the same messages, in the same run);
2. latency at scale: ``scale_latency.measure``, NaN-to-alert through a real publisher beside N quiet
   ranks at 1 Hz, then (unless ``--no-prometheus``, and where Debian's ``prometheus`` and
   ``prometheus-alertmanager`` are installed) the same ranks through Prometheus + Alertmanager;
3. lag and memory: ``soak.soak``, N quiet ranks at 1 Hz for some minutes (RSS counts as flat when
   it grows less than 10% after the warm-up, issue 19's bound for its soak);
4. scale-out: ``throughput.trial`` with 1, 2 and 4 workers of one app (the kill of one of two is
   ``tests/test_kafka_faults.py``);
5. lag is never an alert: the alerts on quiet ranks in 2 and 3 (in 3 the worker falls behind when it
   cannot keep up, which is the case the goal is about).

Each bench starts its own broker and workers and stops them; they share the machine's cores with
the simulated ranks, so run it on an otherwise idle machine. For a goal not met it prints where
stage 1's CPU goes (cProfile of ``throughput.stage1_work`` on that goal's messages) and, for goal 1,
whose run measures the worker's CPU, how much of it per message that work is, the rest being Faust,
stage 2 and the sends. About 27 minutes at the issue's sizes, 5 more with Prometheus; ``--quick``
(smaller sizes, about 6 minutes) checks the bench itself. Asserts nothing.

    python bench/cluster_goals.py
    python bench/cluster_goals.py --quick --only 1 2
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import platform
import pstats
import time
from argparse import Namespace

from rankwatch.broker import free_port
from rankwatch.settings import Settings
from rankwatch.stack import Stack

import scale_latency
import soak
import throughput
from prometheus_baseline import binaries, exit_on_sigterm, measure_prometheus
from scratch import scratch_dir

# (what, value at the sizes, value with --quick)
SIZES = {
    "preload_ranks": (1024, 128),  # goal 1: ranks x 10 messages x (64 steps x 16 metrics), the topic
    "latency_ranks": (1024, 256),
    "trials": (30, 5),
    "soak_ranks": (4096, 512),
    "soak_minutes": (10.0, 1.0),
    "scale_ranks": (1024, 128),  # goal 4: ranks x 30 messages x (1 step x 32 metrics)
}

#: What each goal asks, in the issue's words, shortened.
TARGETS = {
    1: "worker >= 0.5 x a plain read + decode of the JSON; >= 1 M values/s in the binary form",
    2: "1,024 ranks x 32 metrics at 1 Hz: NaN-to-alert p99 <= 250 ms over >= 30, none missed, none on quiet ranks",
    3: "4,096 ranks x 32 metrics at 1 Hz for 10 min: lag < 2 s throughout, RSS flat, nothing dropped",
    4: "1, 2 and 4 workers of one app share the partitions",
    5: "a worker behind raises no stall or straggler",
}

#: Stage 1's parts in the profile: (label, file, function, caller's function or None for any caller).
#: Each is a call that none of the others is inside, so the shares add up.
PARTS = [
    ("decode (contract)", "telemetry.py", "from_bytes", None),
    ("detectors: spike, blowup", "spike.py", "update", None),
    ("detectors: explode", "explode.py", "update", None),
    ("tail-model refits", "processor.py", "fit_due_models", None),
    ("rollup windows", "windows.py", "roll_one", "process"),
    ("rollup windows", "windows.py", "roll", "process"),
    ("rollup windows", "windows.py", "add_one", "process"),
    ("rollups closed", "processor.py", "_rollup", None),
    ("state for the changelog", "codecs.py", "dumps", "work"),
    ("run events (progress, signals)", "batching.py", "flush", None),
    ("encoding rollups and signals", "topics.py", "encoded", "process_in_parts"),
]


def _sized(args, name: str):
    return SIZES[name][1 if args.quick else 0]


def goal1(args) -> dict:
    rows = {}
    for fmt in ("json", "binary"):
        spec = Namespace(ranks=_sized(args, "preload_ranks"), messages=10, steps=64, metrics=16, partitions=8,
                         format=fmt, shape="training", timeout_s=900)
        r = throughput.trial(spec, 1)
        r["spec"] = spec
        rows[fmt] = r
    json_ratio = rows["json"]["plain_wall"] / rows["json"]["worker_wall"]  # the same values in both
    binary = rows["binary"]
    binary_wall = binary["values"] / binary["worker_wall"] / 1e6
    measured = (f"JSON: worker {_rate(rows['json'], 'worker_wall')} against a plain read + decode "
                f"{_rate(rows['json'], 'plain_wall')} M values/s ({json_ratio:.2f}); binary: worker "
                f"{binary_wall:.3f} M values/s ({_rate(binary, 'worker_cpu')} per CPU-second)")
    # The profile's own messages: fewer ranks, the same message (its cost per message is what counts).
    profile = dict(binary, spec=Namespace(**{**vars(binary["spec"]), "ranks": min(binary["spec"].ranks, 128)}))
    return {"met": json_ratio >= 0.5 and binary_wall >= 1.0, "measured": measured, "profile": profile}


def _rate(row: dict, key: str) -> str:
    return f"{row['values'] / row[key] / 1e6:.3f}"


def goal2(args) -> dict:
    settings = Settings(data_dir=scratch_dir("cluster-goals-latency"), partitions=8)
    with Stack(settings, embedded=True, port=free_port()) as stack:
        r = scale_latency.measure(stack.bootstrap, _sized(args, "latency_ranks"), 32, _sized(args, "trials"), 8,
                                  binary=True, shape="training")
    kinds = f" ({', '.join(r['false_kinds'])})" if r["false"] else ""
    measured = (f"{r['ranks']} quiet ranks: p50 {r['p50']:.0f} ms, p99 {r['p99']:.0f} ms, missed {r['missed']} of "
                f"{r['trials']}, {r['false']} alerts on quiet ranks{kinds}")
    met = r["missed"] == 0 and r["p99"] <= 250 and r["false"] == 0 and r["trials"] >= 30
    if not args.no_prometheus:
        measured += _prometheus(r)
    return {"met": met, "measured": measured, "false": r["false"]}


def _prometheus(r: dict) -> str:
    """Goal 2's baseline on the same ranks, after the rankwatch stack has stopped (so that neither
    shares the cores with the other), as a clause of the measured text."""
    if binaries() is None:
        return "; Prometheus + Alertmanager not installed (apt-get install prometheus prometheus-alertmanager)"
    exit_on_sigterm()  # a SIGTERM unwinds, so Prometheus and its exporters are stopped with the bench
    b = measure_prometheus(r["ranks"], 32, r["trials"], 8)
    return (f"; Prometheus + Alertmanager on the same ranks: p50 {b['p50']:.0f} ms, p99 {b['p99']:.0f} ms "
            f"({b['p99'] / r['p99']:.1f} times rankwatch's), missed {b['missed']} of {b['trials']}")


def goal3(args) -> dict:
    spec = Namespace(broker=args.broker, ranks=_sized(args, "soak_ranks"), metrics=32,
                     minutes=_sized(args, "soak_minutes"), workers=1, partitions=8, format="binary", shape="training",
                     every_s=30.0, warmup_min=min(2.0, _sized(args, "soak_minutes") / 2), drain_s=60.0, store=False)
    out = soak.soak(spec)
    growth = 100 * (out["rss_last"] - out["rss_first"]) / out["rss_first"]
    measured = (f"{spec.ranks} ranks, {spec.minutes:g} min on {spec.broker}: max lag {out['lag_max']:.1f} s, RSS "
                f"{growth:+.1f}% after {spec.warmup_min:g} min, {out['finals']} of {spec.ranks} ranks' last "
                f"messages applied within {spec.drain_s:g} s after the ranks stopped")
    met = out["lag_max"] < 2.0 and growth < 10.0 and out["finals"] == spec.ranks
    profile = Namespace(ranks=128, messages=200, steps=1, metrics=32, format="binary",
                        shape="training")
    return {"met": met, "measured": measured, "false": len(out["alerts"]), "lag_max": out["lag_max"],
            "profile": {"spec": profile}}


def goal4(args) -> dict:
    spec = Namespace(ranks=_sized(args, "scale_ranks"), messages=30, steps=1, metrics=32, partitions=8,
                     format="binary", shape="training", timeout_s=900)
    rows = [throughput.trial(spec, n) for n in (1, 2, 4)]
    done = all(math.isfinite(r["worker_wall"]) for r in rows)
    rates = ", ".join(f"{r['workers']}: {_rate(r, 'worker_wall')}" for r in rows)
    measured = (f"M values/s (wall) by workers, {spec.ranks} ranks x 1 step x 32 metrics: {rates}; every rank "
                f"applied with each count: {'yes' if done else 'no'}")
    return {"met": done, "measured": measured}


def stage1_parts(spec: Namespace) -> tuple[float, list[tuple[str, float]]]:
    """CPU µs a message of stage 1's work (no profiler), and each part's share of it under cProfile."""
    work, _ = throughput.stage1_work(spec)
    started = time.process_time()
    ticks = work()
    per_message = (time.process_time() - started) / (len(ticks) * spec.ranks) * 1e6
    profiler = cProfile.Profile(time.process_time)
    profiler.runcall(work)
    stats = pstats.Stats(profiler).stats
    total = next(ct for (file, _, name), (_, _, _, ct, _) in stats.items()
                 if file.endswith("throughput.py") and name == "work")
    shares: dict[str, float] = {}
    for label, file, name, caller in PARTS:
        for (f, _, n), (_, _, _, ct, callers) in stats.items():
            if not (f.endswith(file) and n == name):
                continue
            if caller is not None:
                ct = sum(c[3] for (_, _, cn), c in callers.items() if cn == caller)
            shares[label] = shares.get(label, 0.0) + ct / total
    process = sum(ct for (f, _, n), (_, _, _, ct, _) in stats.items() if f.endswith("processor.py") and n == "process")
    inside = sum(v for k, v in shares.items() if k.startswith(("detectors", "rollup")))
    shares["the rest of process (its loop over metrics)"] = process / total - inside
    shares["other"] = 1.0 - sum(shares.values())
    return per_message, sorted(shares.items(), key=lambda kv: -kv[1])


def _print_profile(goal: str, found: dict) -> None:
    spec = found["spec"]
    per_message, parts = stage1_parts(spec)
    print(f"\nGoal {goal} not met: where stage 1's CPU goes, {spec.ranks} ranks x {spec.messages} messages x "
          f"({spec.steps} steps x {spec.metrics} metrics), {spec.format}, in this process under cProfile")
    if "worker_cpu" in found:
        worker = found["worker_cpu"] / (found["values"] / (spec.steps * spec.metrics)) * 1e6
        print(f"stage 1's work: {per_message:,.0f} µs CPU a message (no profiler); the worker in goal {goal}'s run "
              f"(its start included): {worker:,.0f} µs a message, the rest being Faust's per-record work, stage 2 "
              "and the sends")
    else:
        print(f"stage 1's work: {per_message:,.0f} µs CPU a message (no profiler)")
    print("| part | share of stage 1 |")
    print("|---|---|")
    for label, share in parts:
        print(f"| {label} | {100 * share:.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=int, nargs="+", choices=[1, 2, 3, 4, 5], default=[1, 2, 3, 4, 5],
                    help="goals to measure (5 reads the alerts of 2 and 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the bench, not the goals")
    ap.add_argument("--broker", choices=["tansu", "kafka"], default="tansu", help="goal 3's broker")
    ap.add_argument("--no-prometheus", action="store_true", help="goal 2 without the Prometheus baseline")
    args = ap.parse_args()
    goals = {1: goal1, 2: goal2, 3: goal3, 4: goal4}
    found = {}
    for n in sorted(set(args.only) | ({2, 3} if 5 in args.only else set())):
        if n in goals:
            print(f"\n== goal {n} ==", flush=True)
            found[n] = goals[n](args)
    if 5 in args.only:
        false = found[2]["false"] + found[3]["false"]
        found[5] = {"met": false == 0, "measured": f"{false} alerts on quiet ranks in goals 2 and 3 (goal 3's "
                                                   f"largest lag {found[3]['lag_max']:.1f} s)"}
    load = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, load "
          f"{load[0]:.1f}/{load[1]:.1f}{', --quick: not the issue sizes' if args.quick else ''}")
    print("| goal | target | measured | met |")
    print("|---|---|---|---|")
    for n, r in sorted(found.items()):
        print(f"| {n} | {TARGETS[n]} | {r['measured']} | {'yes' if r['met'] else '**no**'} |")
    for n, r in sorted(found.items()):
        if not r["met"] and "profile" in r:
            _print_profile(str(n), r["profile"])


if __name__ == "__main__":
    main()
