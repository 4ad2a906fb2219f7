"""rankwatch's alerts in a real Prometheus Alertmanager (Debian's ``prometheus-alertmanager``, 0.25),
started here on a free port with a short ``resolve_timeout``. `make test` installs it where apt-get
can (CI); elsewhere these tests are skipped, or fail where $RANKWATCH_REQUIRE_ALL is set.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from conftest import missing, process_alive
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Alert
from rankwatch.sinks import Notifier
from rankwatch.sinks.alertmanager import AlertmanagerSink
from rankwatch.sinks.webhook import Secret

RESOLVE_TIMEOUT_S = 2  # Alertmanager drops a firing alert this long after its last post, unless told otherwise
RESEND_S = 1.0  # each post holds an alert for 4 s


def _binary() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if found is None:
        why = "no Alertmanager binary (Debian: apt-get install prometheus-alertmanager; `make test` does it as root)"
        missing(why)
    return found


class Alertmanager:
    def __init__(self, directory) -> None:
        config = directory / "alertmanager.yml"
        config.write_text(f"global:\n  resolve_timeout: {RESOLVE_TIMEOUT_S}s\n"
                          "route:\n  receiver: nowhere\nreceivers:\n  - name: nowhere\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(directory / "alertmanager.log", "wb")
        self.proc = subprocess.Popen(
            [_binary(), f"--config.file={config}", f"--storage.path={directory / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process_alive(self.proc.pid):
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Alertmanager did not start: {(directory / 'alertmanager.log').read_text()[-2000:]}")

    def alerts(self, run: str, **query: str) -> list[dict]:
        """``GET /api/v2/alerts`` (active, silenced and inhibited unless ``query`` says otherwise) for ``run``."""
        params = "&".join([f"filter=run%3D%22{run}%22", *(f"{k}={v}" for k, v in query.items())])
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts?{params}", timeout=5) as response:
            return json.loads(response.read())

    def silence(self, run: str) -> str:
        now = datetime.now(UTC)
        body = {"matchers": [{"name": "run", "value": run, "isRegex": False, "isEqual": True}],
                "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat(),
                "createdBy": "test", "comment": "the test silences its run"}
        request = urllib.request.Request(f"{self.url}/api/v2/silences", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())["silenceID"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory):
    am = Alertmanager(tmp_path_factory.mktemp("alertmanager"))
    yield am
    am.stop()


def _wait(what, predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if predicate(got):
            return got
        time.sleep(0.2)
    raise AssertionError(f"still {got!r} after {timeout_s:.0f} s")


def _alert(run: str, status: str, ranks: tuple[int, ...], ts: float) -> Alert:
    return Alert(key=Alert.make_key(run, "nonfinite", "loss"), run=run, status=status, severity="critical",
                 detector="nonfinite", metric="loss", rank=ranks[0] if len(ranks) == 1 else None, step=120 + len(ranks),
                 value=float("nan"), message=f"loss is NaN on ranks {ranks}", ts=ts, incident=120, ranks=ranks)


def _publish(bootstrap: str, alert: Alert) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(contract.ALERTS, alert.to_bytes(), key=alert.key.encode())
    producer.flush()
    producer.close()


class Running:
    """``rankwatch notify --webhook --format alertmanager`` as a thread: a Notifier following the topic."""

    def __init__(self, bootstrap: str, run: str, url: str, state) -> None:
        self.stopped = threading.Event()
        self.notifier = Notifier([AlertmanagerSink(Secret(url), resend_s=RESEND_S)], run=run, state_path=state)
        self.thread = threading.Thread(target=self.notifier.follow, args=(bootstrap,),
                                       kwargs={"from_beginning": True, "stop": self.stopped.is_set}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.mark.broker
def test_alertmanager_holds_a_firing_alert_follows_its_growth_and_drops_it_when_resolved(
        bootstrap, run_id, alertmanager, tmp_path):
    started = time.time() - 3.0
    _publish(bootstrap, _alert(run_id, "firing", (0,), started))
    notify = Running(bootstrap, run_id, alertmanager.url, tmp_path / "offsets.json")
    try:
        [shown] = _wait(lambda: alertmanager.alerts(run_id), lambda got: len(got) == 1)
        assert shown["labels"] == {"alertname": "nonfinite/loss", "run": run_id, "detector": "nonfinite",
                                   "metric": "loss", "severity": "critical"}
        assert shown["status"]["state"] == "active" and shown["annotations"]["ranks"] == "0"
        starts_at = shown["startsAt"]
        assert abs(datetime.fromisoformat(starts_at).timestamp() - started) < 0.01  # the real start

        # A second rank joins: the same alert, with the longer list.
        _publish(bootstrap, _alert(run_id, "firing", (0, 1), time.time()))
        [grown] = _wait(lambda: alertmanager.alerts(run_id),
                        lambda got: len(got) == 1 and got[0]["annotations"]["ranks"] == "0,1")
        assert grown["startsAt"] == starts_at

        # Past the resolve timeout and past one post's hold (4 x 1 s), re-sends keep it active.
        time.sleep(4 * RESEND_S + RESOLVE_TIMEOUT_S + 1)
        [held] = alertmanager.alerts(run_id)
        assert held["status"]["state"] == "active" and held["startsAt"] == starts_at
    finally:
        notify.stop()

    # A stopped notifier's alert ends after the hold; a restarted one rebuilds its firing set
    # from the topic and brings it back with its original start.
    _wait(lambda: alertmanager.alerts(run_id), lambda got: got == [], timeout_s=4 * RESEND_S + 10)
    notify = Running(bootstrap, run_id, alertmanager.url, tmp_path / "offsets.json")
    try:
        [back] = _wait(lambda: alertmanager.alerts(run_id), lambda got: len(got) == 1)
        assert back["startsAt"] == starts_at and back["annotations"]["ranks"] == "0,1"

        # A silence set in Alertmanager silences it.
        silence = alertmanager.silence(run_id)
        [silenced] = _wait(lambda: alertmanager.alerts(run_id), lambda got: got[0]["status"]["state"] == "suppressed")
        assert silenced["status"]["silencedBy"] == [silence]
        assert alertmanager.alerts(run_id, silenced="false") == []

        # Resolved: it leaves.
        _publish(bootstrap, _alert(run_id, "resolved", (0, 1), time.time()))
        _wait(lambda: alertmanager.alerts(run_id), lambda got: got == [], timeout_s=15)
    finally:
        notify.stop()
    assert notify.notifier.failed == 0
