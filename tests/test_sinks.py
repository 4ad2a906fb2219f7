"""Sinks: JSONL, terminal, webhook (JSON, Slack, Alertmanager) with retries, and the notifier's bookkeeping."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import consume_json
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.contract import Alert, Series, TelemetryBatch
from rankwatch.sinks import JsonlSink, Notifier, TerminalSink, WebhookSink
from rankwatch.sinks.alertmanager import AlertmanagerSink
from rankwatch.sinks.webhook import DeliveryError, Secret

SECRET_PATH = "/services/T000/B000/very-secret-token"


def _alert(status: str = "firing", *, ranks=(0, 1), run: str = "r", metric: str = "loss",
           message: str = "loss is NaN") -> Alert:
    return Alert(key=f"{run}/nonfinite/{metric}", run=run, status=status, severity="critical", detector="nonfinite",
                 metric=metric, rank=None, step=120, value=float("nan"), message=message, ts=1_700_000_000.0,
                 incident=120, ranks=tuple(ranks))


class Receiver:
    """A real HTTP server on loopback that answers with the given status codes (or (code, headers)), then 200."""

    def __init__(self, codes=()):
        self.codes, self.requests = list(codes), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append((self.path, dict(self.headers), json.loads(body)))
                code = outer.codes.pop(0) if outer.codes else 200
                code, headers = code if isinstance(code, tuple) else (code, {})  # (status, headers) too
                self.send_response(code)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}{SECRET_PATH}"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def receiver(request):
    r = Receiver(getattr(request, "param", ()))
    yield r
    r.close()


def _sink(receiver, **kw) -> WebhookSink:
    return WebhookSink(Secret(receiver.url), backoff_s=0.0, sleep=lambda s: None, **kw)


@pytest.mark.parametrize("receiver", [(500, 503, 429)], indirect=True)
def test_webhook_retries_server_errors_then_delivers_without_logging_the_secret(receiver, caplog):
    caplog.set_level(logging.DEBUG)
    sink = _sink(receiver, token=Secret("tok-123"))
    sink.add(_alert())
    sink.flush()
    assert len(receiver.requests) == 4
    path, headers, body = receiver.requests[-1]
    assert path == SECRET_PATH and headers["Authorization"] == "Bearer tok-123"
    assert body["alerts"][0]["ranks"] == [0, 1] and body["alerts"][0]["value"] == "NaN"
    logged = caplog.text + repr(sink.url) + str(sink.token)
    assert "retrying" in caplog.text
    assert "very-secret-token" not in logged and "tok-123" not in logged


@pytest.mark.parametrize("receiver", [(400,)], indirect=True)
def test_webhook_does_not_retry_a_client_error(receiver):
    sink = _sink(receiver)
    sink.add(_alert())
    with pytest.raises(DeliveryError, match="HTTP 400") as info:
        sink.flush()
    assert len(receiver.requests) == 1 and "very-secret-token" not in str(info.value)


def test_webhook_gives_up_after_its_retries():
    sink = WebhookSink(Secret("http://127.0.0.1:9/x"), retries=2, backoff_s=0.0, sleep=lambda s: None, timeout_s=1)
    sink.add(_alert())
    with pytest.raises(DeliveryError, match="after 3 attempts"):
        sink.flush()


def test_slack_body_is_one_text_line_per_alert(receiver):
    sink = _sink(receiver, format="slack")
    sink.add(_alert())
    sink.add(_alert("resolved"))
    sink.flush()
    [(_, _, body)] = receiver.requests
    lines = body["text"].splitlines()
    assert len(lines) == 2 and "FIRING" in lines[0] and "RESOLVED" in lines[1] and "loss is NaN" in lines[0]


def test_alertmanager_webhook_body_follows_the_v4_webhook_format(receiver):
    sink = _sink(receiver, format="alertmanager-webhook")
    sink.add(_alert())
    sink.flush()
    [(_, _, body)] = receiver.requests
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "rankwatch"
    [alert] = body["alerts"]
    assert alert["labels"] == {"alertname": "nonfinite/loss", "run": "r", "detector": "nonfinite",
                               "metric": "loss", "severity": "critical"}
    assert alert["startsAt"] == "2023-11-14T22:13:20Z" and alert["annotations"]["ranks"] == "0,1"
    assert body["commonLabels"]["run"] == "r" and len(alert["fingerprint"]) == 16
    assert body["groupLabels"] == body["commonLabels"] and body["commonAnnotations"]["ranks"] == "0,1"


def test_alertmanager_api_gets_arrays_one_label_set_per_condition_and_the_real_start_and_end(receiver):
    now = [1_700_000_100.0]
    sink = AlertmanagerSink(Secret(receiver.url.removesuffix(SECRET_PATH)), resend_s=10.0, clock=lambda: now[0],
                            backoff_s=0.0, sleep=lambda s: None)
    one = replace(_alert(ranks=(1,)), rank=1, ts=1_700_000_000.0)
    for alert in (one, replace(one, rank=None, ranks=(1, 2), ts=1_700_000_005.0),
                  replace(one, status="resolved", rank=None, ranks=(1, 2), ts=1_700_000_050.0)):
        sink.add(alert)
        sink.flush()
    paths = {path for path, _, _ in receiver.requests}
    bodies = [body for _, _, body in receiver.requests]
    assert paths == {"/api/v2/alerts"} and all(isinstance(b, list) and len(b) == 1 for b in bodies)
    firing, grown, resolved = (b[0] for b in bodies)
    assert firing["labels"] == grown["labels"] == resolved["labels"]  # no rank label: the group grows
    assert firing["labels"]["alertname"] == "nonfinite/loss" and "rank" not in firing["labels"]
    assert (firing["annotations"]["ranks"], grown["annotations"]["ranks"]) == ("1", "1,2")
    assert firing["startsAt"] == grown["startsAt"] == resolved["startsAt"] == "2023-11-14T22:13:20Z"
    assert firing["endsAt"] == "2023-11-14T22:15:40Z"  # now + 4 x resend: held without a resolve_timeout
    assert resolved["endsAt"] == "2023-11-14T22:14:10Z"  # when it resolved
    assert sink.firing == {}
    sink.tick()
    assert len(receiver.requests) == 3  # nothing fires, nothing to re-send


def test_terminal_lines_show_control_characters_escaped():
    out = io.StringIO()
    TerminalSink(out).add(_alert(run="run\x1b]0;owned\x07", metric="loss\x1b[2J\r\nFAKE ALERT",
                                 message="msg\u202eevil"))
    text = out.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "run=run\\x1b]0;owned\\x07 " in text and "loss\\x1b[2J\\r\\nFAKE ALERT" in text


def test_jsonl_lines_are_the_wire_form(tmp_path):
    sink = JsonlSink(tmp_path / "out" / "alerts.jsonl")
    sink.add(_alert())
    sink.add(_alert("resolved"))
    sink.flush()
    back = [Alert.from_bytes(line.encode()) for line in (tmp_path / "out" / "alerts.jsonl").read_text().splitlines()]
    assert [a.to_dict() for a in back] == [_alert().to_dict(), _alert("resolved").to_dict()]


class ListSink:
    def __init__(self):
        self.got = []

    def add(self, alert):
        self.got.append(alert)

    def flush(self):
        pass


def test_notifier_drops_redeliveries_and_filters_by_run():
    sink = ListSink()
    notifier = Notifier([sink], run="r")
    for alert in [_alert(), _alert(), _alert(run="other"), _alert(ranks=(0, 1, 2)), _alert("resolved")]:
        notifier.handle(alert)
    assert [(a.status, a.ranks) for a in sink.got] == [("firing", (0, 1)), ("firing", (0, 1, 2)), ("resolved", (0, 1))]


@pytest.mark.broker
def test_notify_command_writes_jsonl_and_resumes_where_it_stopped(bootstrap, run_id, tmp_path):
    def nan_batch(rank: int) -> TelemetryBatch:
        return TelemetryBatch(run=run_id, rank=rank, world_size=2, producer=f"p{rank}", seq=0, ts=time.time(),
                              series={"loss": Series(np.array([0]), np.array([float("nan")]))})

    def publish(batch: TelemetryBatch) -> None:
        producer = KafkaProducer(bootstrap_servers=bootstrap)
        producer.send(contract.TELEMETRY, batch.to_bytes(), key=batch.key)
        producer.flush()
        producer.close()

    def notify() -> list[dict]:
        cmd = [sys.executable, "-m", "rankwatch", "notify", "--bootstrap", bootstrap, "--run", run_id, "--once",
               "--from-beginning", "--quiet", "--jsonl", str(out), "--state", str(tmp_path / "offsets.json")]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

    out = tmp_path / "alerts.jsonl"
    publish(nan_batch(0))
    assert consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id), "nothing arrived"
    first = notify()
    assert [(a["metric"], a["ranks"]) for a in first] == [("loss", [0])]
    assert notify() == first  # nothing delivered twice

    publish(nan_batch(1))
    assert consume_json(
        bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["ranks"] == [0, 1],
    ), "nothing arrived"
    assert [a["ranks"] for a in notify()] == [[0], [0, 1]]


@pytest.mark.broker
@pytest.mark.parametrize("receiver", [(503,) * 4], indirect=True)  # down for one run's retries, then back
def test_an_alert_the_receiver_did_not_take_is_sent_by_the_next_run(bootstrap, run_id, receiver, tmp_path):
    alerts = [_alert(run=run_id), _alert("resolved", run=run_id)]
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for alert in alerts:
        producer.send(contract.ALERTS, alert.to_bytes(), key=alert.key.encode())
    producer.flush()
    producer.close()
    assert consume_json(
        bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["status"] == "resolved",
    ), "nothing arrived"

    def run_once() -> Notifier:
        sink = WebhookSink(Secret(receiver.url), retries=1, backoff_s=0.0, sleep=lambda s: None)
        notifier = Notifier([sink], run=run_id, state_path=tmp_path / "offsets.json", attempts=2, retry_s=0.0,
                            sleep=lambda s: None)
        notifier.follow(bootstrap, follow=False, from_beginning=True)
        return notifier

    first = run_once()
    assert (first.delivered, first.failed) == (0, 1) and "HTTP 503" in first.undelivered
    assert len(receiver.requests) == 4  # two tries of the notifier, each with the sink's one retry
    second = run_once()  # the receiver is back
    assert (second.delivered, second.failed, second.undelivered) == (2, 0, None)
    sent = [(a["status"], a["run"]) for _, _, body in receiver.requests[4:] for a in body["alerts"]]
    assert sent == [("firing", run_id), ("resolved", run_id)]
    assert run_once().delivered == 0  # and never twice


HOSTILE_RUN = "reward<http://evil.example|click here>"


@pytest.mark.parametrize("receiver", [((429, {"Retry-After": "7"}),)], indirect=True)
def test_slack_gets_hostile_names_escaped_long_ones_capped_and_its_retry_after_honoured(receiver):
    slept = []
    sink = WebhookSink(Secret(receiver.url), format="slack", backoff_s=0.0, sleep=slept.append, max_batch=1000)
    sink.add(_alert(run=HOSTILE_RUN, metric="a&b" + "m" * 50_000))
    for i in range(100):  # 100 alerts of 1,000 characters each: more than one Slack message holds
        sink.add(_alert(run=f"run-{i}", message="x" * 1000))
    sink.flush()
    assert slept == [7.0]  # Slack's rate limit said when; the backoff (0 s here) did not
    assert len(receiver.requests) == 2
    text = receiver.requests[-1][2]["text"]
    first = text.splitlines()[0]
    assert "`reward&lt;http://evil.example|click here&gt;`" in first and "<" not in text and ">" not in text
    assert "a&amp;bmmm" in first and "…[truncated]" in first and len(first) < 1000
    assert len(text) <= 40_000 and text.endswith("more alert(s) not shown]")


@pytest.mark.broker
@pytest.mark.parametrize("receiver", [(400,) * 3], indirect=True)
def test_notify_command_says_how_many_alerts_stayed_undelivered_and_why(bootstrap, run_id, receiver, tmp_path):
    alert = _alert(run=run_id)
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(contract.ALERTS, alert.to_bytes(), key=alert.key.encode())
    producer.flush()
    producer.close()
    cmd = [sys.executable, "-m", "rankwatch", "notify", "--bootstrap", bootstrap, "--run", run_id, "--once",
           "--from-beginning", "--quiet", "--webhook", "--state", str(tmp_path / "offsets.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANKWATCH_WEBHOOK_URL": receiver.url})
    assert done.returncode == 1 and len(receiver.requests) == 3  # three tries, then it stops before the alert
    assert "delivered 0, undelivered 1" in done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("undelivered:")]
    assert alert.key in line and "HTTP 400" in line and "the next run starts with it" in line


@pytest.mark.broker
def test_a_reader_that_follows_waits_for_a_broker_started_after_it(monkeypatch, run_id):
    """``rankwatch alerts --follow`` typed beside ``rankwatch up``: the reader may come first."""
    from rankwatch.broker import EmbeddedBroker, free_port
    from rankwatch.sinks import read_topic, reader

    monkeypatch.setattr(reader, "BOOTSTRAP_TIMEOUT_S", 1.0)  # what one that does not follow would wait
    port, topic, got = free_port(), f"late-{run_id}", []
    deadline = time.monotonic() + 30

    def follow():
        for record in read_topic(f"127.0.0.1:{port}", topic, follow=True,
                                 stop=lambda: bool(got) or time.monotonic() > deadline):
            got.append(record.value)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(3)
    with EmbeddedBroker(port=port) as broker:
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        producer.send(topic, b"late").get(timeout=10)
        producer.close()
        thread.join(timeout=35)
    assert got == [b"late"]
