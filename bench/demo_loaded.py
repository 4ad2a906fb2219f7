"""The demo on an over-full host: every alert it raises that is not the injected NaN's, and which
stragglers its compute time names, with and without the CPU wait.

Issue 18 asks that ``rankwatch demo`` raise no false alert on a loaded machine. On two cores shared by
four ranks, the broker, the worker and busy processes, the scheduler leaves one rank's thread waiting
for a CPU for several steps running, and the compute-time rule used to call that rank a straggler.
The hook now publishes that wait (``cpu_wait_s``) and takes it out of ``compute_time_s``.

This starts ``rankwatch up`` (embedded broker, one worker) and runs ``rankwatch demo --bootstrap``
``--runs`` times beside 1 or 2 busy processes (alternating, or ``--busy``), recording each run's
telemetry. Every firing alert the worker sent for the run is read back from ``rankwatch.alerts``: any
other than the NaN's page (its first alert and the updates of its key and incident) and the evaluation
alerts at or after the NaN's step is false, and listed. Each recording is then replayed through the
default rules (``scenario_replay``) twice: with ``compute_time_s`` as the hook published it, and as it
was before ``cpu_wait_s`` (the step time less data wait and collectives, worked out from the same
recording). Prints a table; asserts nothing.

    python bench/demo_loaded.py --runs 18
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert, TelemetryBatch
from rankwatch.demo.run import is_nan_page
from rankwatch.sinks import read_topic
from rankwatch.stream_processors.rules import Rules
from scenario_replay import replay
from scratch import scratch_dir

RANKWATCH = [sys.executable, "-m", "rankwatch"]
NAN_RANK, NAN_STEP = 2, 120  # the demo's defaults


def _ranks(a: Alert) -> str:
    return ",".join(map(str, a.ranks)) if a.ranks else str(a.rank)


def false_alerts(bootstrap: str, run: str) -> tuple[str, list[str]]:
    """The ranks the injected NaN's page named when it first went out, and the number of versions
    sent ("" if it was never paged); and every other firing alert the worker sent for ``run`` (one
    per key and incident): none of them had a cause."""
    alerts = [Alert.from_bytes(r.value) for r in read_topic(bootstrap, contract.ALERTS)]
    alerts = [a for a in alerts if a.run == run and a.status == "firing"]
    page = next(((a.key, a.incident) for a in alerts if is_nan_page(a, NAN_RANK, NAN_STEP)), None)
    versions = [a for a in alerts if (a.key, a.incident) == page]
    paged = f"ranks {_ranks(versions[0])} ({len(versions)} sent)" if versions else ""
    false = {}
    for a in alerts:
        if (a.key, a.incident) == page or (a.detector.startswith("eval_") and a.step >= NAN_STEP):
            continue
        false.setdefault((a.key, a.incident), f"{a.detector}/{a.metric} ranks {_ranks(a)} step {a.step}")
    return paged, list(false.values())


def _before_cpu_wait(series: dict) -> list[float]:
    """``compute_time_s`` as the hook worked it out before it published ``cpu_wait_s``."""
    def of(metric: str) -> dict[int, float]:
        found = series.get(metric)
        return dict(zip(found["steps"], found["values"])) if found else {}

    took, data, collective = of("step_time_s"), of("data_wait_s"), of("collective_time_s")
    return [max(0.0, took[s] - data.get(s, 0.0) - collective.get(s, 0.0)) for s in series["compute_time_s"]["steps"]]


def stragglers(path: Path, rules: Rules) -> dict[str, list[str]]:
    """The ``crossrank`` alerts the rules fire on this recording, with each way of working out compute time."""
    lines = path.read_text().splitlines()[1:]
    messages = [m for m in (json.loads(line)["value"] for line in lines) if m.get("kind") == "telemetry"]
    found = {}
    for way in ("before", "now"):
        batches = []
        for message in messages:
            series = message["series"]
            if way == "before" and "compute_time_s" in series:
                series = {**series, "compute_time_s": {**series["compute_time_s"], "values": _before_cpu_wait(series)}}
            batches.append(TelemetryBatch.from_bytes(json.dumps({**message, "series": series}).encode()))
        alerts = [emitted.alert for emitted in replay(batches, rules, messages[0]["run"])]
        found[way] = [f"{a.metric} rank {a.rank} step {a.step}" for a in alerts
                      if a.detector == "crossrank" and a.status == "firing"]
    return found


def cpu_wait_share(path: Path) -> float:
    """The ranks' CPU wait as a share of their step time, over the whole run."""
    waited = took = 0.0
    for line in path.read_text().splitlines()[1:]:
        series = json.loads(line)["value"].get("series", {})
        if "step_time_s" in series and "cpu_wait_s" in series:
            waited += sum(series["cpu_wait_s"]["values"])
            took += sum(series["step_time_s"]["values"])
    return waited / took if took else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=12, help="demo runs (default 12)")
    ap.add_argument("--busy", type=int, nargs="+", default=[2, 1], help="busy processes beside each run, cycled")
    ap.add_argument("--keep", type=Path, help="keep the recordings here")
    args = ap.parse_args()
    rules = Rules.load(None)
    where = args.keep or Path(scratch_dir("demo-loaded"))
    where.mkdir(parents=True, exist_ok=True)
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    up = subprocess.Popen([*RANKWATCH, "up", "--port", str(port), "--no-serve"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    print(f"rankwatch up on {bootstrap}; {args.runs} demo runs; recordings in {where}", flush=True)
    print("| run | busy | load | exit | NaN's page first named | false alerts (live) | CPU wait / step time "
          "| straggler alerts replayed, old compute | now |")
    print("|---|---|---|---|---|---|---|---|---|")
    counts = {"before": 0, "now": 0, "false": 0, "paged": 0}
    try:
        time.sleep(15)  # the broker and the worker are up before the first rank publishes
        for i in range(args.runs):
            n, run = args.busy[i % len(args.busy)], f"loaded-{os.getpid()}-{i}"
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
            try:
                demo = subprocess.run([*RANKWATCH, "demo", "--bootstrap", bootstrap, "--run", run],
                                      capture_output=True, timeout=300)
                load = os.getloadavg()[0]
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            recording = where / f"{run}.jsonl"
            subprocess.run([*RANKWATCH, "record", "--bootstrap", bootstrap, "--run", run, str(recording)],
                           capture_output=True, timeout=120, check=True)
            found = stragglers(recording, rules)
            paged, false = false_alerts(bootstrap, run)
            counts = {"before": counts["before"] + bool(found["before"]), "now": counts["now"] + bool(found["now"]),
                      "false": counts["false"] + bool(false), "paged": counts["paged"] + bool(paged)}
            print(f"| {i} | {n} | {load:.1f} | {demo.returncode} | {paged or 'NOT PAGED'} | "
                  f"{'; '.join(false) or '-'} | {cpu_wait_share(recording):.0%} | "
                  f"{', '.join(found['before']) or '-'} | {', '.join(found['now']) or '-'} |", flush=True)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
    print(f"\nruns whose NaN was paged: {counts['paged']} of {args.runs}; runs with a false alert (live): "
          f"{counts['false']} of {args.runs}")
    print(f"runs with a straggler alert, replayed: {counts['before']} of {args.runs} with the old compute time, "
          f"{counts['now']} of {args.runs} now")


if __name__ == "__main__":
    main()
