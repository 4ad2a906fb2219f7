"""NaN-to-alert latency of Prometheus + Alertmanager, what users run today (issue 16, goal 2's baseline).

The same cluster as ``bench/scale_latency.py``: N quiet ranks (``rankwatch.sim.QuietRanks``' values,
M metrics each, a new step every second) and rank 0, whose ``loss`` is NaN for one step every
``gap`` steps. Here the ranks are ``prometheus-client`` exporters: one gauge per metric, labelled
``rank`` (``layer00/weight_norm`` is served as ``layer00_weight_norm``). The quiet ranks are served by
ceil(N / 256) exporter processes, 256 ranks each, one scrape target per process; rank 0 is one more
target, served from this process, so that the moment its NaN starts being served is known here. At
1,024 quiet ranks that is 5 targets and 32,800 series.

Prometheus (Debian's ``prometheus``) scrapes them with 1 s scrape and evaluation intervals and one
rule per metric, ``m != m or abs(m) == Inf`` with ``for: 0s``, as rankwatch's ``nonfinite`` watches
every metric for NaN and ±infinity; the alert carries the series' ``rank`` and a ``metric`` label.
It sends to a real Alertmanager (Debian's ``prometheus-alertmanager``) whose one receiver is a webhook
served by this process on loopback. The latency is from the moment rank 0's exporter serves the NaN
to the moment the webhook receives the firing alert of that incident; any alert naming a quiet rank
(or no rank) is counted as false. Both binaries are looked up on PATH (``prometheus``, and
``prometheus-alertmanager`` or ``alertmanager``); ``apt-get install prometheus prometheus-alertmanager``.

One notification per trial: Alertmanager notifies a *new* group after ``group_wait`` (0 s here), but
a group that already notified waits for its next ``group_interval`` tick, and a resolved alert's
group lingers until Alertmanager's maintenance (every 30 s) removes it. With the same labels on every
trial's alert, every trial after the first would measure ``group_interval``, not the alert path. So
rank 0's NaN series carries an ``incident`` label (the trial's number; the label is absent on its
normal values) and the route groups by every label (``group_by: ['...']``): each trial is a new
alert in a new group, notified at once, the way a first NaN in a run is. The NaN lasts one step, as
in the rankwatch half; the alert resolves in Prometheus one or two evaluations later, and ``gap``
(8 steps by default) leaves it gone long before the next.

The scrape and evaluation schedules have fixed phases (Prometheus spreads targets and rule groups
over the interval by a hash), so a NaN at a fixed point of each second would meet them at the same
point every trial. A trainer's steps keep no time with Prometheus: before each NaN step rank 0
pauses for a random 0-1 s, so the trials sample the phase uniformly. What they cannot sample is the
evaluation's phase relative to rank 0's scrapes: for one Prometheus it is fixed, so the
scrape-to-evaluation part of the latency is one number per run, somewhere in 0-1 s, drawn anew by
another run (other ports, another rule file path).

A NaN that lasts one step is in one scrape, and only the evaluation of the following second sees it
as the latest sample. When evaluating the rules takes longer than the interval, Prometheus skips the
evaluations it is late for, and a NaN that fell into a skipped one never alerts: those are counted
as missed, not in the percentiles. A second table shows where the time goes: the latency's three
parts, the rule group's duration and skipped evaluations, the slowest scrape, and the cores used.
``--loss-only`` keeps one rule (on ``loss``) instead of one per metric, to tell the rules' cost apart.

    python bench/prometheus_baseline.py --ranks 1024 --trials 30

Prints a table; asserts nothing. ``bench/scale_latency.py`` runs it after the rankwatch half.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import numpy as np
from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry
from prometheus_exporters import Rank0Collector, start_exporters
from prometheus_processes import HOST, Webhook, binaries, cpu_s, get, start_alerting, wait_targets_up

from rankwatch.broker import free_port

WARMUP_S = 5  # after every target is up: a few scrapes and evaluations before the first NaN
SETTLE_S = 5  # after the last NaN: time for a late alert to arrive


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _drive(rank0: Rank0Collector, trials: int, gap: int, rng: np.random.Generator) -> dict[int, float]:
    """Rank 0's steps at 1 Hz, one NaN step every ``gap``; returns incident -> when its NaN was served."""
    served, step, t = {}, 0, time.time()
    for incident in range(1, trials + 1):
        for _ in range(gap - 1):
            step, t = step + 1, t + 1.0
            _sleep_until(t)
            rank0.set_step(step)
        step, t = step + 1, t + 1.0 + rng.uniform(0.0, 1.0)  # see the module's doc string: the phase
        _sleep_until(t)
        rank0.set_step(step, str(incident))
        served[incident] = time.time()
        t = time.time()
    _sleep_until(t + 1.0)
    rank0.set_step(step + 1)
    return served


def _query(prometheus_url: str, promql: str) -> list[dict]:
    return json.loads(get(f"{prometheus_url}/api/v1/query?query={urllib.parse.quote(promql)}"))["data"]["result"]


def _scraped(prometheus_url: str) -> dict[int, float]:
    """incident -> the timestamp of its NaN sample in Prometheus, i.e. when that scrape began."""
    result = _query(prometheus_url, 'loss{rank="0",incident!=""}[1h]')
    return {int(r["metric"]["incident"]): float(r["values"][0][0]) for r in result}


def _slowest_scrape_ms(prometheus_url: str) -> float:
    # a scrape that took near 1 s would mean the exporters, not Prometheus' schedule, set the pace
    [r] = _query(prometheus_url, "max(max_over_time(scrape_duration_seconds[1h]))")
    return float(r["value"][1]) * 1000


def _own(text: str, series: str) -> float:
    """The value on the first line of Prometheus' own metrics that starts with ``series``."""
    return float(re.search(rf"^{re.escape(series)}\S* (\S+)$", text, re.MULTILINE).group(1))


def _evaluations(prometheus_url: str) -> dict:
    """How long the rule group took (Prometheus' own summary: its last 10 minutes) and how many of its
    1 s evaluations were skipped because the one before had not finished: a NaN that lasts one scrape
    is seen only by the evaluation of its second, so a skipped one misses it."""
    own = get(f"{prometheus_url}/metrics").decode()
    return {"group_ms_p50": 1000 * _own(own, 'prometheus_rule_group_duration_seconds{quantile="0.5"}'),
            "group_ms_p99": 1000 * _own(own, 'prometheus_rule_group_duration_seconds{quantile="0.99"}'),
            "evaluations": int(_own(own, "prometheus_rule_group_iterations_total")),
            "skipped": int(_own(own, "prometheus_rule_group_iterations_missed_total"))}


def _ms(a: list[float], q: float) -> float:
    return float(np.percentile(np.array(a) * 1000, q)) if len(a) else float("nan")


def _summary(served: dict[int, float], scraped: dict[int, float], webhook: Webhook) -> dict:
    got = [i for i in served if i in webhook.seen]
    parts = [i for i in got if i in scraped]
    lat = [webhook.seen[i][0] - served[i] for i in got]
    to_scrape = [scraped[i] - served[i] for i in parts]
    to_eval = [webhook.seen[i][1] - scraped[i] for i in parts]
    to_hook = [webhook.seen[i][0] - webhook.seen[i][1] for i in parts]
    return {"trials": len(served), "missed": len(served) - len(got),
            "p50": _ms(lat, 50), "p99": _ms(lat, 99), "max": _ms(lat, 100),
            "scrape_p50": _ms(to_scrape, 50), "scrape_max": _ms(to_scrape, 100),
            "eval_p50": _ms(to_eval, 50), "eval_max": _ms(to_eval, 100),
            "notify_p50": _ms(to_hook, 50), "notify_max": _ms(to_hook, 100),
            "false": len(webhook.false),
            "false_kinds": sorted({f"{f.get('metric')}@rank{f.get('rank')}" for f in webhook.false.values()})}


def measure_prometheus(ranks: int, metrics: int, trials: int, gap: int, *, loss_only: bool = False,
                       seed: int = 0) -> dict:
    """Start exporters, Alertmanager and Prometheus, inject ``trials`` NaNs ``gap`` steps apart, stop
    everything. Returns latencies in ms (p50, p99, max, and the median and max of their three parts),
    the NaNs without an alert (missed), the alerts on quiet ranks (false), and the cores used.
    ``loss_only``: one rule, on ``loss``, instead of one per metric."""
    if gap < 3:
        raise ValueError("gap must be at least 3 steps: the NaN, its resolution, a normal step")
    found = binaries()
    if found is None:
        raise FileNotFoundError("prometheus and/or prometheus-alertmanager not on PATH")
    rank0 = Rank0Collector(metrics)
    names = rank0.names[:1] if loss_only else rank0.names
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rankwatch-prometheus-")))
        webhook = stack.enter_context(Webhook())
        registry = CollectorRegistry(auto_describe=False)
        registry.register(rank0)
        rank0_port = free_port()
        server, _ = start_http_server(rank0_port, addr=HOST, registry=registry)
        stack.callback(server.server_close)
        stack.callback(server.shutdown)
        exporters = start_exporters(stack, tmp, ranks, metrics, time.time())
        targets = [f"{HOST}:{rank0_port}", *(target for target, _ in exporters)]
        url, alerting = start_alerting(stack, tmp, found, targets, webhook.url, names)
        wait_targets_up(url, len(targets))
        time.sleep(WARMUP_S)
        quiet = [proc for _, proc in exporters]
        began, cpu = time.time(), (cpu_s(alerting), cpu_s(quiet))
        served = _drive(rank0, trials, gap, np.random.default_rng(seed))
        time.sleep(SETTLE_S)
        took = time.time() - began
        return {"ranks": ranks, "targets": len(targets), "rules": len(names),
                **_summary(served, _scraped(url), webhook), **_evaluations(url),
                "slowest_scrape_ms": _slowest_scrape_ms(url),
                "alerting_cores": (cpu_s(alerting) - cpu[0]) / took, "exporter_cores": (cpu_s(quiet) - cpu[1]) / took}


def exit_on_sigterm() -> None:
    """A SIGTERM unwinds like Ctrl-C, so that the child processes are stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def print_table(rows: list[dict], metrics: int) -> None:
    load = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {load[0]:.1f}/{load[1]:.1f}; "
          f"NaN-to-alert, Prometheus + Alertmanager, {metrics} metrics per rank, 1 step/s, "
          "1 s scrape and evaluation intervals")
    print("| quiet ranks | targets | rules | NaNs | missed | p50 ms | p99 ms | max ms | alerts on quiet ranks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kinds = f" ({', '.join(r['false_kinds'][:5])})" if r["false"] else ""
        print(f"| {r['ranks']} | {r['targets']} | {r['rules']} | {r['trials']} | {r['missed']} | {r['p50']:.0f} "
              f"| {r['p99']:.0f} | {r['max']:.0f} | {r['false']}{kinds} |")
    print("\nWhere the time goes (ms, p50 / max over the NaNs that alerted; rule group: Prometheus' own summary)")
    print("| quiet ranks | NaN→scrape | scrape→evaluation | evaluation→webhook | rule group p50 / p99 "
          "| evaluations skipped | slowest scrape ms | cores: Prometheus + Alertmanager / exporters |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['scrape_p50']:.0f} / {r['scrape_max']:.0f} | {r['eval_p50']:.0f} / {r['eval_max']:.0f} "
              f"| {r['notify_p50']:.0f} / {r['notify_max']:.0f} | {r['group_ms_p50']:.0f} / {r['group_ms_p99']:.0f} "
              f"| {r['skipped']} of {r['evaluations']} | {r['slowest_scrape_ms']:.0f} "
              f"| {r['alerting_cores']:.2f} / {r['exporter_cores']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024], help="quiet ranks (rank 0 comes on top)")
    ap.add_argument("--metrics", type=int, default=32)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--gap-steps", type=int, default=8, help="steps between NaNs")
    ap.add_argument("--loss-only", action="store_true", help="one rule, on loss, instead of one per metric")
    args = ap.parse_args()
    if binaries() is None:
        print("Prometheus and/or Alertmanager not installed (apt-get install prometheus prometheus-alertmanager)")
        return
    exit_on_sigterm()
    rows = []
    for n in args.ranks:
        print(f"measuring Prometheus + Alertmanager on {n} quiet ranks + rank 0, {args.trials} NaNs …", flush=True)
        rows.append(measure_prometheus(n, args.metrics, args.trials, args.gap_steps, loss_only=args.loss_only))
    print_table(rows, args.metrics)


if __name__ == "__main__":
    main()
