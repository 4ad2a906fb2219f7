"""The processes of the Prometheus baseline: Prometheus and Alertmanager (Debian's packages) started
and stopped in order, their configuration, and the webhook that hears Alertmanager's notifications.
``bench/prometheus_baseline.py`` says what is measured; ``bench/prometheus_exporters.py`` serves the ranks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rankwatch.broker import free_port

HOST = "127.0.0.1"


def binaries() -> tuple[str, str] | None:
    """(prometheus, alertmanager) from PATH, or None when either is missing."""
    prometheus = shutil.which("prometheus")
    alertmanager = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    return (prometheus, alertmanager) if prometheus and alertmanager else None



# --- the webhook -------------------------------------------------------------------------------

class Webhook:
    """Alertmanager's receiver: when each incident's firing alert arrived, and the false ones."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: dict[int, tuple[float, float]] = {}  # incident -> (received, Prometheus' startsAt)
        self.false: dict[str, dict] = {}  # labels as JSON -> labels, of each alert on a quiet rank
        self.server = ThreadingHTTPServer((HOST, 0), self._handler())
        self.url = f"http://{HOST}:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self):
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                received = time.time()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.end_headers()
                webhook.note(received, body)

            def log_message(self, *args):
                pass

        return Handler

    def note(self, received: float, body: dict) -> None:
        with self.lock:
            for alert in body.get("alerts", []):
                labels = alert["labels"]
                if alert["status"] != "firing":
                    continue
                if labels.get("rank") != "0":
                    self.false.setdefault(json.dumps(labels, sort_keys=True), labels)
                elif labels.get("metric") == "loss" and labels.get("incident"):
                    self.seen.setdefault(int(labels["incident"]), (received, _timestamp(alert["startsAt"])))

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _timestamp(rfc3339: str) -> float:
    # Go writes nanoseconds; fromisoformat takes at most microseconds
    head, _, frac = rfc3339.removesuffix("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


# --- the processes -----------------------------------------------------------------------------

def _stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def start(stack: contextlib.ExitStack, argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` stopped by ``stack`` whatever happens; its own session, so that a Ctrl-C reaches
    only the bench, which then stops it in order."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    stack.callback(_stop, proc, log)
    return proc


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read()


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            get(url)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer: {log_path.read_text(errors='replace')[-2000:]}")


def wait_targets_up(prometheus_url: str, targets: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        active = json.loads(get(f"{prometheus_url}/api/v1/targets?state=active"))["data"]["activeTargets"]
        if sum(t["health"] == "up" for t in active) == targets:
            return
        time.sleep(0.5)
    raise RuntimeError(f"not all {targets} targets up after {timeout_s:.0f} s: {active}")


def _rules(names: list[str]) -> dict:
    rules = [{"alert": "NonFinite", "expr": f"{n} != {n} or abs({n}) == Inf", "for": "0s",
              "labels": {"metric": n, "severity": "critical"},
              "annotations": {"summary": f"{n} is NaN or infinite on rank {{{{ $labels.rank }}}}"}} for n in names]
    return {"groups": [{"name": "nonfinite", "rules": rules}]}


def _prometheus_config(targets: list[str], alertmanager: str) -> dict:
    # JSON is YAML: no YAML writer needed
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
            "scrape_configs": [{"job_name": "ranks", "static_configs": [{"targets": targets}]}]}


def _alertmanager_config(webhook_url: str) -> dict:
    return {"route": {"receiver": "bench", "group_by": ["..."], "group_wait": "0s", "group_interval": "1s",
                      "repeat_interval": "1h"},
            "receivers": [{"name": "bench", "webhook_configs": [{"url": webhook_url, "send_resolved": False}]}]}



def start_alerting(stack, tmp: Path, binaries_: tuple[str, str], targets: list[str], webhook_url: str,
                    names: list[str]) -> tuple[str, list[subprocess.Popen]]:
    """Alertmanager, then Prometheus; returns Prometheus' URL and both processes once both are ready."""
    prometheus, alertmanager = binaries_
    am_port, prom_port = free_port(), free_port()
    (tmp / "alertmanager.yml").write_text(json.dumps(_alertmanager_config(webhook_url)))
    am = start(stack, [alertmanager, f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am'}",
                        # no cluster: one Alertmanager needs no gossip port, nor to wait at start for peers to settle
                        f"--web.listen-address={HOST}:{am_port}", "--cluster.listen-address="],
                tmp / "alertmanager.log")
    wait_ready(f"http://{HOST}:{am_port}/-/ready", am, tmp / "alertmanager.log")
    (tmp / "rules.yml").write_text(json.dumps(_rules(names)))
    (tmp / "prometheus.yml").write_text(json.dumps(_prometheus_config(targets, f"{HOST}:{am_port}")))
    prom = start(stack, [prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address={HOST}:{prom_port}"],
                  tmp / "prometheus.log")
    url = f"http://{HOST}:{prom_port}"
    wait_ready(f"{url}/-/ready", prom, tmp / "prometheus.log")
    return url, [prom, am]


def cpu_s(procs: list[subprocess.Popen]) -> float:
    """CPU seconds (user + system) the processes used so far."""
    ticks = 0
    for proc in procs:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")
