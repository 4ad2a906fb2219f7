"""``rankwatch demo``: the whole loop on one machine, in well under two minutes.

Broker (embedded unless a bootstrap is given) -> a Faust worker -> 4 training ranks as separate
processes -> a NaN injected on one rank -> alerts printed as they arrive -> a summary. Exit 0 when
the expected page arrived: firing on the injected rank at the injected step, with ``loss`` its
``metric`` or among its ``metrics`` (one incident is one page since issue 18).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert, EvalReport
from rankwatch.settings import Settings
from rankwatch.stack import Stack
from rankwatch.sinks import TerminalSink, read_topic


def _describe(report: EvalReport) -> str:
    acc = report.metrics.get("correct", {})
    ranks = f"{len(report.ranks_received)}/{report.world_size} ranks"
    if not acc:
        return f"eval {report.eval_id}: no accuracy ({ranks})"
    return (f"eval at step {report.step:>4}: accuracy {acc['mean']:.3f} [{acc['ci_low']:.3f}, {acc['ci_high']:.3f}]"
            f" on {report.n_samples} samples from {ranks}")


def _is_expected(alert: Alert, nan_rank: int, nan_step: int) -> bool:
    """The page that covers the injected NaN: firing, on the injected rank, starting at the injected
    step, with ``loss`` among its metrics. Since issue 18 a NaN reaching loss, grad norm and weights is
    one page, keyed under its first, most severe condition (``metric`` may be ``grad_norm``) and
    listing every metric in ``metrics``; a page of one condition has ``metric`` only."""
    metrics = set(alert.metrics) | {alert.metric}
    ranks = set(alert.ranks) | ({alert.rank} if alert.rank is not None else set())
    return (alert.status == "firing" and "loss" in metrics and nan_rank in ranks
            and nan_step in (alert.incident, alert.step))


def _page(alert: Alert) -> str:
    metrics = ", ".join(alert.metrics or (alert.metric,))
    ranks = ",".join(map(str, alert.ranks)) if alert.ranks else str(alert.rank)
    return (f"{alert.severity} {alert.detector}/{alert.metric} page at step {alert.incident or alert.step} "
            f"on rank(s) {ranks}, metrics [{metrics}]")


def run_demo(settings: Settings, *, embedded: bool, ranks: int = 4, steps: int = 200,
             nan_step: int = 120, nan_rank: int = 2, wait_s: float = 20.0) -> int:
    started = time.monotonic()
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"rankwatch demo: run {run}, {ranks} ranks x {steps} steps, NaN on rank {nan_rank} at step {nan_step}")
    with Stack(settings, embedded=embedded, port=free_port()) as stack:
        where = f"embedded broker (memory only) at {stack.bootstrap}" if embedded else f"broker at {stack.bootstrap}"
        print(f"  {where}; worker ready after {time.monotonic() - started:.1f}s")
        seen: list[Alert] = []
        matched: list[Alert] = []
        expected = threading.Event()
        stop = threading.Event()
        sink = TerminalSink()

        def watch() -> None:
            for record in read_topic(stack.bootstrap, contract.ALERTS, follow=True):
                if stop.is_set():
                    return
                alert = Alert.from_bytes(record.value)
                if alert.run != run:
                    continue
                seen.append(alert)
                sink.add(alert)
                sink.flush()
                if not expected.is_set() and _is_expected(alert, nan_rank, nan_step):
                    matched.append(alert)
                    print(f"  ^ the injected NaN: {_page(alert)}", flush=True)
                    expected.set()

        reports: dict[str, EvalReport] = {}

        def watch_reports() -> None:
            for record in read_topic(stack.bootstrap, contract.REPORTS, follow=True):
                if stop.is_set():
                    return
                obj = contract.decode_any(record.value)
                if obj.get("kind") != EvalReport.KIND or obj.get("run") != run:
                    continue
                report = EvalReport.from_bytes(record.value)
                if report.provisional or report.eval_id in reports:
                    continue
                reports[report.eval_id] = report
                print(f"  {_describe(report)}", flush=True)

        threading.Thread(target=watch, daemon=True, name="alert-watch").start()
        threading.Thread(target=watch_reports, daemon=True, name="report-watch").start()
        env = dict(os.environ, WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "rankwatch.demo.train", "--run", run, "--bootstrap", stack.bootstrap,
                 "--steps", str(steps), "--nan-step", str(nan_step), "--nan-rank", str(nan_rank)],
                env=dict(env, RANK=str(r)),
            )
            for r in range(ranks)
        ]
        try:
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        expected.wait(wait_s)
        time.sleep(1.0)  # let the last alerts of the run print before the summary
        stop.set()
    by_severity = Counter(a.severity for a in seen if a.status == "firing")
    if reports:
        print("\neval accuracy over training (95% CI, all ranks merged):")
        for report in sorted(reports.values(), key=lambda r: r.step):
            print(f"  {_describe(report)}")
    print(f"\nsummary: {len(seen)} alert transitions ({dict(by_severity)}) in {time.monotonic() - started:.1f}s; "
          f"ranks exited {codes}")
    print(f"stored in the report store: rankwatch report --run {run}  (rollups, eval reports, alerts)")
    if expected.is_set():
        print(f"OK: the injected NaN (rank {nan_rank}, step {nan_step}) was detected: {_page(matched[0])}")
        return 0
    print(f"FAILED: no firing page covering loss for rank {nan_rank} at step {nan_step}")
    return 1
