"""`rankwatch worker` stops within 10 s of SIGTERM in every state (issue 15): with its broker gone,
and after an agent crashed. Real worker processes on the real embedded broker."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.broker import EmbeddedBroker, free_port
from rankwatch.stack import READY_LINE

pytestmark = pytest.mark.broker

STOP_WITHIN_S = 10.0

# The telemetry agent crashes at its first event: the exception escapes the agent, as a bug would.
_CRASHING = """
import sys
import faust.streams
events, noack_take = faust.streams.Stream.events, faust.streams.Stream.noack_take
async def crashing(self):
    async for event in events(self):
        raise RuntimeError("an agent crash, for the test")
        yield event
async def crashing_take(self, *args, **kwargs):  # stage 1 takes its events in batches
    async for batch in noack_take(self, *args, **kwargs):
        raise RuntimeError("an agent crash, for the test")
        yield batch
faust.streams.Stream.events, faust.streams.Stream.noack_take = crashing, crashing_take
from rankwatch.cli import main
sys.exit(main(["worker", "--bootstrap", sys.argv[1]]))
"""


def _start_worker(bootstrap: str, out, *, crashing: bool) -> subprocess.Popen:
    code = ["-c", _CRASHING, bootstrap] if crashing else ["-m", "rankwatch", "worker", "--bootstrap", bootstrap]
    proc = subprocess.Popen([sys.executable, *code], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while READY_LINE not in open(out.name).read() and time.monotonic() < deadline:
        assert proc.poll() is None, open(out.name).read()
        time.sleep(0.2)
    assert READY_LINE in open(out.name).read(), open(out.name).read()
    return proc


def _seconds_to_stop(proc: subprocess.Popen) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - started


@pytest.mark.parametrize("state", ["broker_down", "agent_crashed"])
def test_sigterm_stops_the_worker_within_ten_seconds(tmp_path, state):
    broker = EmbeddedBroker(port=free_port()).start()
    log = tmp_path / "worker.out"
    with open(log, "w") as out:
        proc = _start_worker(broker.bootstrap, out, crashing=state == "agent_crashed")
        try:
            if state == "broker_down":
                broker.stop()
                time.sleep(3)  # the worker's clients are retrying
            else:
                producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
                producer.send(contract.TELEMETRY, b"{}", key=b"r/0")
                producer.close()
                deadline = time.monotonic() + 20
                while "an agent crash, for the test" not in log.read_text() and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert "an agent crash, for the test" in log.read_text(), log.read_text()
            took = _seconds_to_stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            broker.stop()
    assert took < STOP_WITHIN_S, f"{took:.1f}s; output:\n{log.read_text()[-3000:]}"
