"""Readers that start at the end show only what arrives afterwards; `up` says which broker it uses.

On the embedded broker ListOffsets(LATEST) answers the base offset of the last record batch + 1
(Tansu quirk 4), so a reader that seeks to "the end" with it replays the rest of that batch. Old
alerts sent together in one batch make the difference visible.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.contract import Alert

RANKWATCH = [sys.executable, "-m", "rankwatch"]


def _alert(run: str, step: int) -> Alert:
    return Alert(key=f"{run}/nonfinite/loss", run=run, status="firing", severity="critical", detector="nonfinite",
                 metric="loss", rank=0, step=step, value=float("nan"), message="loss is NaN", ts=time.time(),
                 incident=step, ranks=(0,))


def _publish(bootstrap: str, alerts: list[Alert], partition: int) -> None:
    # One partition and a linger: the alerts go in one record batch.
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=200)
    for alert in alerts:
        producer.send(contract.ALERTS, alert.to_bytes(), partition=partition)
    producer.flush()
    producer.close()


@pytest.mark.broker
def test_tail_from_end_prints_no_old_alert(bootstrap, run_id):
    old, new = f"{run_id}-old", f"{run_id}-new"
    # The new alerts go to another partition, so the old batch stays the last one of its own
    # however early they come (the tail needs seconds to start, and nothing says when it is ready).
    _publish(bootstrap, [_alert(old, step) for step in range(5)], partition=0)
    tail = subprocess.Popen([*RANKWATCH, "tail", contract.ALERTS, "--follow", "--from-end", "--bootstrap", bootstrap],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in tail.stdout], daemon=True).start()
    printed = []
    try:
        # The tail is positioned when something new shows: publish new alerts until one does.
        deadline = time.monotonic() + 60
        while not any(json.loads(line)["run"] == new for line in printed) and time.monotonic() < deadline:
            _publish(bootstrap, [_alert(new, 100)], partition=1)
            try:
                while True:
                    printed.append(lines.get(timeout=1.0))
            except queue.Empty:
                pass
    finally:
        tail.terminate()
        tail.wait(10)
    runs = [json.loads(line)["run"] for line in printed]
    assert new in runs, (runs, tail.stderr.read())
    assert old not in runs, runs


def _up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "RANKWATCH_BOOTSTRAP"} | (env or {})
    return subprocess.run([*RANKWATCH, "up", *args], capture_output=True, text=True, timeout=60, env=environ)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_up_refuses_a_port_with_a_bootstrap_in_one_line(how):
    if how == "flag":
        done = _up("--port", "9999", "--bootstrap", "127.0.0.1:1")
    else:
        done = _up("--port", "9999", env={"RANKWATCH_BOOTSTRAP": "127.0.0.1:1"})
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "--port" in line and "127.0.0.1:1" in line
    assert ("$RANKWATCH_BOOTSTRAP" in line) == (how == "environment")
