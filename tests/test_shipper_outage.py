"""The shipper through a broker outage, on the real embedded broker (issue 15): it retries quietly
(no traceback lands on the training process's stderr) and delivers everything once the broker is back."""

from __future__ import annotations

import time

import pytest
from conftest import consume_json

from rankwatch import contract
from rankwatch.broker import EmbeddedBroker, free_port
from rankwatch.producers import RankPublisher

pytestmark = pytest.mark.broker

DOWN_S = 12.0  # past the shipper's connect (5 s) and request (10 s) timeouts: its sends fail meanwhile


def test_a_broker_outage_leaves_no_traceback_and_loses_nothing_sent_after_it(run_id, capfd):
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=broker.bootstrap, samplers=[],
                              linger_s=0.05)
    try:
        step = 0

        def log_for(seconds: float) -> None:
            nonlocal step
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                publisher.log({"loss": float(step)}, step)
                step += 1
                time.sleep(0.05)

        log_for(1.0)
        broker.stop()  # memory only: what it held is gone with it
        killed_at = step
        log_for(DOWN_S)
        broker = EmbeddedBroker(port=port).start()
        log_for(1.0)
        assert publisher.flush(timeout_s=30), publisher.stats()
        publisher.close()
        stats = publisher.stats()
        assert stats.failed == 0 and stats.dropped == 0, stats
        wanted = set(range(killed_at, step))

        def steps(found: list[dict]) -> set[int]:
            return {s for b in found for s in b["series"].get("loss", {}).get("steps", [])}

        batches = consume_json(broker.bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id,
                               until=lambda found: wanted <= steps(found), timeout_s=30)
        assert wanted <= steps(batches), sorted(wanted - steps(batches))[:10]
    finally:
        publisher.close()
        broker.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
