"""``rankwatch demo``: the whole loop on one machine, in well under two minutes.

Broker (embedded unless a bootstrap is given) -> a Faust worker -> 4 training ranks as separate
processes -> a NaN injected on one rank -> alerts printed as they arrive -> a summary. Exit 0 when
the expected page arrived: firing on the injected rank at the injected step (or the next: see
``is_nan_page``), with ``loss`` its
``metric`` or among its ``metrics`` (one incident is one page since issue 18). With ``nan_step < 0``
nothing is injected, and the demo exits 0 when every rank finished and the final evaluation was reported.

Each run has its own id (``demo-<time>``, ``-lr<X>`` added for a learning rate other than the default) and
stores into the report store of the data dir, so runs made one after another can be compared:
``rankwatch report --compare R1 R2``.
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
from rankwatch.errors import RankwatchError
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


def is_nan_page(alert: Alert, nan_rank: int, nan_step: int) -> bool:
    """The page that covers the injected NaN: firing, on the injected rank, with ``loss`` among its
    metrics, starting at the injected step or the next. Since issue 18 a NaN reaching loss, grad norm
    and weights is one page, keyed under its first, most severe condition (``metric`` may be
    ``grad_norm``) and listing every metric in ``metrics``; a page of one condition has ``metric`` only.
    The all-reduce puts the NaN into every rank's weights at the injected step, so the other ranks'
    loss is NaN from the next one; when one of theirs reaches the worker first, the loss page starts
    there, and the injected rank's loss joins it (a page's step is fixed once it is sent)."""
    metrics = set(alert.metrics) | {alert.metric}
    ranks = set(alert.ranks) | ({alert.rank} if alert.rank is not None else set())
    return (alert.status == "firing" and "loss" in metrics and nan_rank in ranks
            and bool({nan_step, nan_step + 1} & {alert.incident, alert.step}))


def _page(alert: Alert) -> str:
    metrics = ", ".join(alert.metrics or (alert.metric,))
    ranks = ",".join(map(str, alert.ranks)) if alert.ranks else str(alert.rank)
    return (f"{alert.severity} {alert.detector}/{alert.metric} page at step {alert.incident or alert.step} "
            f"on rank(s) {ranks}, metrics [{metrics}]")


DEFAULT_LR = 0.1  # rankwatch.demo.train's default


def run_id(lr: float = DEFAULT_LR, now: float | None = None) -> str:
    """``demo-<local time>``, with the learning rate when it is not the default.

    >>> run_id(0.1, now=0.0) == run_id(now=0.0), run_id(0.02, now=0.0).endswith("-lr0.02")
    (True, True)
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"demo-{stamp}" + ("" if lr == DEFAULT_LR else f"-lr{lr:g}")


def run_demo(settings: Settings, *, embedded: bool, ranks: int = 4, steps: int = 200,
             nan_step: int = 120, nan_rank: int = 2, lr: float = DEFAULT_LR, run: str | None = None,
             wait_s: float = 20.0) -> int:
    started = time.monotonic()
    run = run or run_id(lr)
    inject = 0 <= nan_step < steps
    if ranks < 1 or steps < 1:
        raise RankwatchError(f"the demo needs at least one rank and one step (--ranks {ranks}, --steps {steps})")
    if inject and not 0 <= nan_rank < ranks:
        raise RankwatchError(f"--nan-rank {nan_rank} is not one of the {ranks} ranks (0-{ranks - 1}); "
                             f"--nan-step -1 injects no NaN")
    fault = f"NaN on rank {nan_rank} at step {nan_step}" if inject else "no fault injected"
    print(f"rankwatch demo: run {run}, {ranks} ranks x {steps} steps, lr {lr:g}, {fault}")
    with Stack(settings, embedded=embedded, port=free_port()) as stack:
        where = f"embedded broker (memory only) at {stack.bootstrap}" if embedded else f"broker at {stack.bootstrap}"
        print(f"  {where}; worker ready after {time.monotonic() - started:.1f}s")
        seen: list[Alert] = []
        matched: list[Alert] = []
        expected = threading.Event()
        stop = threading.Event()
        sink = TerminalSink()

        def watch() -> None:
            for record in read_topic(stack.bootstrap, contract.ALERTS, follow=True, stop=stop.is_set):
                alert = Alert.from_bytes(record.value)
                if alert.run != run:
                    continue
                seen.append(alert)
                sink.add(alert)
                sink.flush()
                if not expected.is_set() and is_nan_page(alert, nan_rank, nan_step):
                    matched.append(alert)
                    print(f"  ^ the injected NaN: {_page(alert)}", flush=True)
                    expected.set()

        reports: dict[str, EvalReport] = {}
        final_reported = threading.Event()  # the evaluation of the final weights (step == steps)

        def watch_reports() -> None:
            for record in read_topic(stack.bootstrap, contract.REPORTS, follow=True, stop=stop.is_set):
                obj = contract.decode_any(record.value)
                if obj.get("kind") != EvalReport.KIND or obj.get("run") != run:
                    continue
                report = EvalReport.from_bytes(record.value)
                if report.provisional or report.eval_id in reports:
                    continue
                reports[report.eval_id] = report
                print(f"  {_describe(report)}", flush=True)
                if report.step >= steps:
                    final_reported.set()

        watchers = [threading.Thread(target=watch, daemon=True, name="alert-watch"),
                    threading.Thread(target=watch_reports, daemon=True, name="report-watch")]
        for thread in watchers:
            thread.start()
        env = dict(os.environ, WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "rankwatch.demo.train", "--run", run, "--bootstrap", stack.bootstrap,
                 "--steps", str(steps), "--nan-step", str(nan_step if inject else -1), "--nan-rank", str(nan_rank),
                 "--lr", repr(lr)],
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
        deadline = time.monotonic() + wait_s
        for event in (expected, final_reported) if inject else (final_reported,):
            event.wait(max(0.0, deadline - time.monotonic()))
        time.sleep(1.0)  # let the last alerts of the run print before the summary
        stop.set()
        for thread in watchers:  # their consumers close before the broker stops (it waits for connected clients)
            thread.join(10.0)
    by_severity = Counter(a.severity for a in seen if a.status == "firing")
    if reports:
        print("\neval accuracy over training (95% CI, all ranks merged):")
        for report in sorted(reports.values(), key=lambda r: r.step):
            print(f"  {_describe(report)}")
    print(f"\nsummary: {len(seen)} alert transitions ({dict(by_severity)}) in {time.monotonic() - started:.1f}s; "
          f"ranks exited {codes}")
    print(f"stored in the report store: rankwatch report --run {run}  (rollups, eval reports, alerts)")
    if not inject:
        if any(codes) or not final_reported.is_set():
            print(f"FAILED: ranks exited {codes}; final evaluation (step {steps}) "
                  f"{'reported' if final_reported.is_set() else f'not reported within {wait_s:g}s'}")
            return 1
        print(f"OK: {ranks} ranks trained {steps} steps at lr {lr:g}; the final evaluation was reported")
        return 0
    if expected.is_set():
        # The page as its last update left it: the ranks and metrics that joined after its first send.
        latest = [a for a in seen if a.key == matched[0].key and a.status == "firing"][-1]
        print(f"OK: the injected NaN (rank {nan_rank}, step {nan_step}) was detected: {_page(latest)}")
        return 0
    print(f"FAILED: no firing page covering loss for rank {nan_rank} at step {nan_step} or {nan_step + 1}")
    return 1
