"""A restarted embedded broker (which forgets everything) must not silence the monitor (issue 15).

Its own broker and worker: the test kills the broker for longer than the stall bound, starts a new
one on the same port, and expects the worker to start over by itself, alert on a NaN again within
seconds, and raise no stall for the outage.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import TEST_RULES, consume_json
from kafka import KafkaAdminClient

from rankwatch import contract
from rankwatch.admin import KEPT_COUNT_LINE
from rankwatch.broker import EmbeddedBroker, free_port
from rankwatch.errors import BrokerError
from rankwatch.producers import RankPublisher
from rankwatch.settings import Settings
from rankwatch.stack import Stack
from rankwatch.stream_processors.worker import NEW_BROKER_LINE

pytestmark = pytest.mark.broker

WORLD = 2
OUTAGE_S = 15.0  # longer than the stall bound (at least 10 s): long enough for a false stall
ALERT_WITHIN_S = 30.0


@pytest.fixture
def restart_stack(tmp_path):
    settings = Settings(data_dir=str(tmp_path), rules=str(TEST_RULES), app_id="rankwatch-restart-test")
    with Stack(settings, embedded=True, port=free_port()) as stack:
        yield stack


def restart_broker(stack: Stack, down_s: float) -> None:
    """Kill the broker, wait, start a new (empty) one on the same port; retry while the port is held."""
    old = stack.broker
    old.stop()
    time.sleep(down_s)
    deadline = time.monotonic() + 30
    while True:
        try:
            stack.broker = EmbeddedBroker(port=old.port, log_path=old.log_path).start()
            return
        except BrokerError:  # the old one's port not yet free (AddrInUse)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Ranks:
    """WORLD ranks stepping ten times a second in a thread, as a training job would, all along."""

    def __init__(self, bootstrap: str, run: str):
        self.publishers = [RankPublisher(run=run, rank=r, world_size=WORLD, bootstrap=bootstrap, samplers=[],
                                         heartbeat_s=1.0, linger_s=0.05) for r in range(WORLD)]
        self.step, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for p in self.publishers:
                p.log({"lr": 0.1}, self.step)
            self.step += 1

    def nan(self, metric: str) -> None:
        self.publishers[0].log({metric: float("nan")}, self.step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for p in self.publishers:
            p.close()


def _firing(run: str, metric: str):
    return lambda a: a["run"] == run and a["metric"] == metric and a["status"] == "firing"


def test_after_a_broker_restart_the_worker_starts_over_and_alerts_with_no_stall(restart_stack, run_id):
    stack = restart_stack
    ranks = Ranks(stack.bootstrap, run_id)
    try:
        time.sleep(4)  # the stall detector learns the pace (ten gaps)
        ranks.nan("before")
        assert consume_json(stack.bootstrap, contract.ALERTS, _firing(run_id, "before"), timeout_s=30), \
            "the monitor did not work before the restart"

        restart_broker(stack, OUTAGE_S)
        restarted = time.monotonic()
        [worker] = stack.workers
        deadline = restarted + ALERT_WITHIN_S
        while not any(NEW_BROKER_LINE in line for line in worker.tail) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(NEW_BROKER_LINE in line for line in worker.tail), "\n".join(worker.tail)
        assert worker.proc.poll() is None  # it started over in place

        ranks.nan("after")
        found = consume_json(stack.bootstrap, contract.ALERTS, _firing(run_id, "after"),
                             timeout_s=max(deadline - time.monotonic(), 1.0))
        took = time.monotonic() - restarted
        assert found, f"no alert {took:.0f}s after the restart; worker output:\n" + "\n".join(worker.tail)
        said = list(worker.tail)  # its lines about the restart, before later ones push them out
        print(f"alert {took:.1f}s after the new broker started")
        time.sleep(5)  # the ranks' spooled steps are in; a stall would be out by now
    finally:
        ranks.close()
    stalls = consume_json(stack.bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["detector"] == "stall",
                          timeout_s=3)
    assert stalls == [], stalls
    # The worker re-created the topics with the configured partition count (the broker auto-creates
    # with 4). A rank's shipper may reconnect first and fill the auto-created topic: then the worker
    # keeps it, since deleting would lose those steps, and says so.
    admin = KafkaAdminClient(bootstrap_servers=stack.bootstrap)
    try:
        [described] = admin.describe_topics([contract.TELEMETRY])
    finally:
        admin.close()
    count = len(described["partitions"])
    kept = f"{KEPT_COUNT_LINE} {contract.TELEMETRY} has {count} partitions, not {stack.settings.partitions}"
    assert count == stack.settings.partitions or any(kept in line for line in said), "\n".join(said)
