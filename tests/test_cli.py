"""The rankwatch command as a user runs it: real processes, real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import consume_json, process_alive
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.broker import EmbeddedBroker, free_port, port_is_free
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.errors import BrokerError
from rankwatch.stack import READY_LINE

RANKWATCH = [sys.executable, "-m", "rankwatch"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKWATCH, *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_command_and_the_memory_only_broker():
    out = _cli("--help").stdout
    for command in ("up", "broker", "worker", "alerts", "tail", "demo"):
        assert command in out
    assert "IN MEMORY ONLY" in out and "RANKWATCH_BOOTSTRAP" in out


def _send_nan_loss(bootstrap: str, run: str) -> None:
    """One rank-0 telemetry message, straight to the broker: loss 1.0 at step 0, NaN at step 1."""
    batch = TelemetryBatch(run=run, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                           series={"loss": Series(np.array([0, 1]), np.array([1.0, float("nan")]))})
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(contract.TELEMETRY, batch.to_bytes(), key=batch.key)
    producer.flush()
    producer.close()


@pytest.mark.broker
@pytest.mark.both_brokers
def test_alerts_and_tail_print_what_is_on_the_topics(bootstrap, run_id):
    _send_nan_loss(bootstrap, run_id)
    assert consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id), "nothing arrived"

    shown = _cli("alerts", "--bootstrap", bootstrap, "--run", run_id, "--json")
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    assert shown.returncode == 0 and len(lines) == 1
    assert (lines[0]["run"], lines[0]["metric"], lines[0]["value"]) == (run_id, "loss", "NaN")

    text = _cli("alerts", "--bootstrap", bootstrap, "--run", run_id).stdout
    assert "CRITICAL" in text and "loss is NaN on rank 0 at step 1" in text

    tailed = _cli("tail", contract.TELEMETRY, "--bootstrap", bootstrap).stdout
    assert any(json.loads(line).get("run") == run_id for line in tailed.splitlines())


def test_tail_refuses_a_topic_that_is_not_rankwatch_s():
    result = _cli("tail", "some.other.topic")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--ranks", "0"], "at least one rank and one step"),
    (["--nan-rank", "4"], "--nan-rank 4 is not one of the 4 ranks (0-3)"),
])
def test_demo_refuses_a_shape_it_cannot_run_before_starting_anything(args, says):
    result = _cli("demo", *args, "--bootstrap", "127.0.0.1:1")  # nothing listens: nothing may be asked of it
    assert result.returncode == 2 and result.stderr.startswith("rankwatch: error: ") and says in result.stderr
    assert result.stderr.count("\n") == 1 and not result.stdout


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


def _api_answers(base: str, bootstrap: str, run: str) -> None:
    """The report API that `up` started: its OpenAPI document and /metrics, and a run sent to the broker
    reaches it through the worker and the store (an alert on a NaN loss)."""
    status, ctype, body = _get(f"{base}openapi.json")
    assert (status, ctype) == (200, "application/json") and "/runs/{run}/rollups" in json.loads(body)["paths"]
    status, ctype, body = _get(f"{base}metrics")
    assert status == 200 and ctype.startswith("text/plain") and b"# TYPE rankwatch_alert_firing gauge" in body
    _send_nan_loss(bootstrap, run)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and f'run="{run}"'.encode() not in (metrics := _get(f"{base}metrics")[2]):
        time.sleep(0.5)
    assert b"rankwatch_alert_firing{" in metrics and f'run="{run}"'.encode() in metrics, metrics[-2000:]
    [stored] = [r for r in json.loads(_get(f"{base}runs")[2]) if r["run"] == run]
    assert (stored["alerts"], stored["firing"]) == (1, 1)


@pytest.mark.parametrize("stop,serve", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl_c-serve", "sigterm-no_serve"])
def test_up_starts_everything_and_ctrl_c_or_sigterm_stops_it_cleanly(tmp_path, stop, serve, run_id):
    port = free_port()
    api_port = next(p for p in iter(free_port, None) if p != port)
    env = dict(os.environ, RANKWATCH_DATA_DIR=str(tmp_path))
    env.pop("RANKWATCH_BOOTSTRAP", None)
    api = ["--serve-port", str(api_port)] if serve else ["--no-serve"]
    proc = subprocess.Popen([*RANKWATCH, "up", "--port", str(port), *api], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    banner_seen = threading.Event()

    def read() -> None:  # all of it, to the end: a full pipe would block the process
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                banner_seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert banner_seen.wait(120), "".join(lines)
        banner = "".join(lines)
        assert f"127.0.0.1:{port}" in banner and "memory only" in banner, banner
        assert not port_is_free("127.0.0.1", port)
        if serve:
            assert f"api      http://127.0.0.1:{api_port}/ (openapi.json, runs, metrics)" in banner, banner
            _api_answers(f"http://127.0.0.1:{api_port}/", f"127.0.0.1:{port}", run_id)
        else:
            assert "api      off (--no-serve)" in banner and port_is_free("127.0.0.1", api_port), banner
        proc.send_signal(stop)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # rankwatch prints every thread's stack
            time.sleep(1)
            pytest.fail(f"rankwatch up did not stop within 30 s of {stop.name}; its output:\n" + "".join(lines))
        reader.join(5)
        assert code == 0, "".join(lines)
        assert "stopped" in lines[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert port_is_free("127.0.0.1", port) and port_is_free("127.0.0.1", api_port)  # all went down with it


_SUPERVISOR = """
import os, subprocess, sys, time
from rankwatch.broker import EmbeddedBroker
from rankwatch.stack import PARENT_ENV
broker = EmbeddedBroker(port=int(sys.argv[1])).start()
with open(sys.argv[2], "w") as out:  # a file, not a pipe: the worker must not die of a broken pipe instead
    worker = subprocess.Popen([sys.executable, "-m", "rankwatch", "worker", "--bootstrap", broker.bootstrap],
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                              env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_the_broker_and_worker_of_a_supervisor_killed_outright_stop_too(tmp_path):
    # Both run in their own sessions (Ctrl-C reaches only the supervisor), so nothing else stops them,
    # and a broker left behind would keep the port from the next `rankwatch up`.
    port, output = free_port(), tmp_path / "worker.out"
    supervisor = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(port), str(output)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, RANKWATCH_DATA_DIR=str(tmp_path)))
    worker = int(supervisor.stdout.readline())
    try:
        deadline = time.monotonic() + 90
        while READY_LINE not in output.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert READY_LINE in output.read_text(), output.read_text()
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 30
        while (process_alive(worker) or not port_is_free("127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_alive(worker), output.read_text()
        assert port_is_free("127.0.0.1", port)
    finally:
        supervisor.kill()
        if process_alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_broker_start_fails_clearly_when_the_port_is_taken():
    with EmbeddedBroker(port=free_port()) as running:
        with pytest.raises(BrokerError, match="is taken"):
            EmbeddedBroker(port=running.port).start()


def test_broker_start_fails_clearly_without_a_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "missing-tansu"))
    with pytest.raises(BrokerError, match="no Tansu broker binary"):
        EmbeddedBroker(port=free_port()).start()


@pytest.mark.broker
def test_tail_before_any_worker_creates_no_topic():
    # A one-partition topic made by a reader would cap the system at one worker for good.
    from kafka import KafkaAdminClient

    with EmbeddedBroker(port=free_port()) as broker:
        result = _cli("tail", contract.TELEMETRY, "--bootstrap", broker.bootstrap)
        assert result.returncode == 0, result.stderr
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        try:
            assert contract.TELEMETRY not in admin.list_topics()
        finally:
            admin.close()
