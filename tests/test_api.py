"""``rankwatch serve``: a real HTTP server on loopback over a real SQLite store; JSON routes, the OpenAPI
document, the bearer token, and ``/metrics`` through prometheus-client with a bounded rank count."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from test_store import _window_rollup, alert, records, report

from rankwatch.errors import RankwatchError
from rankwatch.sinks.api import ReportAPI, make_server
from rankwatch.sinks.store import ReportStore


@pytest.fixture
def store_path(tmp_path):
    path = str(tmp_path / "store.db")
    store = ReportStore(path)
    now = time.time()
    rollups = [_window_rollup("r1", rank, [1.0 + rank, 2.0 + rank, 3.0 + rank], start=start, world=8)
               for rank in range(8) for start in (0, 100)]
    store.write(records(*rollups, report(run="r1")))
    store.write(records(alert(run="r1", ts=now), topic="rankwatch.alerts"))
    store.close()
    return path


def _serve(path, token=None, **kw):
    server = make_server(ReportAPI(path, registry=CollectorRegistry(), **kw), "127.0.0.1", 0, token=token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_json_routes_answer_from_the_store(store_path):
    server, base = _serve(store_path)
    try:
        status, ctype, body = _get(f"{base}/runs")
        [run] = json.loads(body)
        assert (status, ctype) == (200, "application/json")
        assert (run["run"], run["first_step"], run["world_size"], run["alerts"], run["firing"]) == ("r1", 0, 8, 1, 1)
        assert [m["metric"] for m in json.loads(_get(f"{base}/runs/r1/metrics")[2])] == ["loss"]
        rows = json.loads(_get(f"{base}/runs/r1/rollups?rank=all&steps=100:")[2])
        assert [(r["rank"], r["ranks"], r["start_step"], r["count"]) for r in rows] == [(None, 8, 100, 24)]
        assert isinstance(rows[0]["p99"], float)
        assert len(json.loads(_get(f"{base}/runs/r1/rollups?rank=3")[2])) == 2
        [rep] = json.loads(_get(f"{base}/runs/r1/eval-reports?metric=correct")[2])
        assert list(rep["metrics"]) == ["correct"]
        [a] = json.loads(_get(f"{base}/runs/r1/alerts?since=1h")[2])
        assert a["value"] == "NaN"  # strict JSON, as on the wire
        assert len(json.loads(_get(f"{base}/alerts/firing")[2])) == 1
        assert _get(f"{base}/runs/r1/rollups?steps=x")[0] == 400
        assert _get(f"{base}/nope")[0] == 404
        doc = json.loads(_get(f"{base}/openapi.json")[2])
        assert doc["openapi"].startswith("3.") and "/runs/{run}/rollups" in doc["paths"]
    finally:
        server.shutdown()


def test_metrics_export_latest_windows_and_firing_alerts_with_a_bound_on_ranks(store_path):
    server, base = _serve(store_path, metrics_max_ranks=2)
    try:
        status, ctype, body = _get(f"{base}/metrics")
        text = body.decode()
        assert status == 200 and ctype.startswith("text/plain")
        assert 'rankwatch_rollup_p99{metric="loss",rank="all",run="r1"}' in text
        assert 'rankwatch_rollup_mean{metric="loss",rank="1",run="r1"} 3.0' in text
        rollup_ranks = {line.split('rank="')[1].split('"')[0] for line in text.splitlines()
                        if line.startswith("rankwatch_rollup_")}
        assert rollup_ranks == {"0", "1", "all"}  # ranks 2..7 are over the bound
        assert 'rankwatch_rollup_last_step{metric="loss",rank="all",run="r1"} 102.0' in text
        assert 'rankwatch_alert_firing{detector="nonfinite",metric="loss",rank="2",run="r1",severity="critical"} 1.0' in text
    finally:
        server.shutdown()


def test_a_token_is_required_off_loopback_and_checked_when_set(store_path):
    with pytest.raises(RankwatchError, match="RANKWATCH_API_TOKEN"):
        make_server(ReportAPI(store_path, registry=CollectorRegistry()), "0.0.0.0", 0)
    server, base = _serve(store_path, token="s3cret")
    try:
        assert _get(f"{base}/runs")[0] == 401
        assert _get(f"{base}/runs", token="wrong")[0] == 401
        assert _get(f"{base}/runs", token="s3cret")[0] == 200
    finally:
        server.shutdown()


def test_rankwatch_serve_command(store_path):
    proc = subprocess.Popen([sys.executable, "-m", "rankwatch", "serve", "--port", "0", "--store", store_path],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("rankwatch serve: http://127.0.0.1:")
        base = line.split()[2].rstrip("/")
        assert _get(f"{base}/openapi.json")[0] == 200
        assert b"rankwatch_rollup_p50" in _get(f"{base}/metrics")[2]
    finally:
        proc.terminate()
        proc.wait(10)
