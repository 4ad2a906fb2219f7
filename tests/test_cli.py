"""The rankwatch command as a user runs it: real processes, real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import consume_json
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.broker import EmbeddedBroker, free_port, port_is_free
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.errors import BrokerError

RANKWATCH = [sys.executable, "-m", "rankwatch"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKWATCH, *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_command_and_the_memory_only_broker():
    out = _cli("--help").stdout
    for command in ("up", "broker", "worker", "alerts", "tail", "demo"):
        assert command in out
    assert "IN MEMORY ONLY" in out and "RANKWATCH_BOOTSTRAP" in out


@pytest.mark.broker
def test_alerts_and_tail_print_what_is_on_the_topics(bootstrap, run_id):
    batch = TelemetryBatch(run=run_id, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                           series={"loss": Series(np.array([0, 1]), np.array([1.0, float("nan")]))})
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(contract.TELEMETRY, batch.to_bytes(), key=batch.key)
    producer.flush()
    producer.close()
    consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id)

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


def test_up_starts_everything_and_ctrl_c_stops_it_cleanly(tmp_path):
    port = free_port()
    env = dict(os.environ, RANKWATCH_DATA_DIR=str(tmp_path))
    env.pop("RANKWATCH_BOOTSTRAP", None)
    proc = subprocess.Popen([*RANKWATCH, "up", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        banner = "".join(lines)
        assert f"127.0.0.1:{port}" in banner and "memory only" in banner, banner
        assert not port_is_free("127.0.0.1", port)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert port_is_free("127.0.0.1", port)  # the broker went down with it


def test_broker_start_fails_clearly_when_the_port_is_taken():
    with EmbeddedBroker(port=free_port()) as running:
        with pytest.raises(BrokerError, match="is taken"):
            EmbeddedBroker(port=running.port).start()


def test_broker_start_fails_clearly_without_a_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "missing-tansu"))
    with pytest.raises(BrokerError, match="no Tansu broker binary"):
        EmbeddedBroker(port=free_port()).start()
