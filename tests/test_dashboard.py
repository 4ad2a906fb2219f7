"""The Grafana dashboard in compose/ against a real ``rankwatch serve``: every series, label and label
value its queries name is exported by ``serve`` (run with compose's own arguments) over a real store
holding rollups and a firing alert, scraped with the bearer token as Prometheus sends it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_compose import DASHBOARD, compose, interpolate, services  # noqa: F401 (fixtures)
from test_store import _window_rollup, alert, records, report

from rankwatch.sinks.store import ReportStore

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_WORDS = {"and", "or", "unless", "bool", "offset", "atan2"}
TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<braces>\{[^{}]*\})
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<space>\s+)
  | (?P<other>.)""", re.X)
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GRAFANA_VAR = re.compile(r"\$\{\w+(?::\w+)?\}|\$\w+|\[\[\w+\]\]")


def query_problems(expr: str, exported: dict[str, list[dict[str, str]]], legend: str = "") -> list[str]:
    """What in a PromQL query names something ``exported`` lacks: a series with no samples, a label no
    sample of it has, a literal label value none has, a grouping or legend label none of its series has.
    ``exported`` maps each series to its samples' label sets."""
    tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(GRAFANA_VAR.sub("GRAFANA_VAR", expr))
              if m.lastgroup != "space"]
    problems, labels_seen, grouping = [], set(), set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1] if i + 1 < len(tokens) else (None, None)
        if kind == "braces":
            problems.append(f"{expr!r}: a selector without a series name: {text}")
        elif kind == "ident" and text in GROUPING and after[1] == "(":
            close = next(j for j in range(i + 1, len(tokens)) if tokens[j][1] == ")")
            grouping |= {t for k, t in tokens[i + 2:close] if k == "ident"}
            i = close
        elif kind == "ident" and text not in AGGREGATIONS | OPERATOR_WORDS and after[1] != "(":
            samples = exported.get(text, [])
            if not samples:
                problems.append(f"{expr!r}: no series {text} in rankwatch serve's /metrics")
            labels_seen |= {k for s in samples for k in s}
            matchers = []
            if after[0] == "braces":
                matchers = MATCHER.findall(after[1])
                i += 1  # the braces belong to this series
            for label, op, value in matchers:
                having = [s for s in samples if label in s]
                if samples and not having:
                    problems.append(f"{expr!r}: {text} has no label {label}")
                elif "GRAFANA_VAR" not in value and op in ("=", "!=") and having and \
                        not any((s[label] == value) == (op == "=") for s in having):
                    problems.append(f"{expr!r}: no sample of {text} has {label}{op}{value!r}")
        i += 1
    for label in grouping | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)):
        if label not in labels_seen:
            problems.append(f"{expr!r}: label {label} (grouping or legend) is on none of its series")
    return problems


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) for every panel target and every query variable."""
    found = [(f"panel {p['title']!r}", t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"]
             for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
        assert m, f"variable {variable['name']}: only label_values(series, label) queries are checked: {query}"
        found.append((f"variable {variable['name']!r}", m.group(1), f"{{{{{m.group(2)}}}}}"))
    return found


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """A real report store with rollups of 4 ranks over two windows, an eval report and a firing alert."""
    path = str(tmp_path_factory.mktemp("compose-store") / "store.db")
    store = ReportStore(path)
    rollups = [_window_rollup("r1", rank, [1.0 + rank, 2.0 + rank, float("nan")], start=start, world=4)
               for rank in range(4) for start in (0, 100)]
    store.write(records(*rollups, report(run="r1")))
    store.write(records(alert(run="r1", ts=time.time()), topic="rankwatch.alerts"))
    store.close()
    return path


@pytest.fixture(scope="module")
def exported(services, store_path) -> dict[str, list[dict[str, str]]]:  # noqa: F811 (the fixture)
    """rankwatch serve, started with compose's own arguments (bound to loopback on a free port), scraped
    the way Prometheus scrapes it: with the bearer token."""
    token = "compose-test-token"
    argv = [interpolate(a) for a in services["serve"]["command"]]
    proc = subprocess.Popen([sys.executable, "-m", "rankwatch", *argv, "--host", "127.0.0.1", "--port", "0",
                             "--store", store_path], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RANKWATCH_API_TOKEN": token})
    try:
        line = proc.stdout.readline()
        assert line.startswith("rankwatch serve: http://127.0.0.1:") and "bearer token required" in line, line
        url = line.split()[2].rstrip("/") + "/metrics"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=30)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    finally:
        proc.terminate()
        proc.wait(30)
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def test_every_series_the_dashboard_queries_is_exported_by_rankwatch_serve(exported):
    assert exported["rankwatch_alert_firing"], "the store's firing alert is exported"
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 10
    problems = [f"{where}: {p}" for where, expr, legend in queries for p in query_problems(expr, exported, legend)]
    assert problems == []
    used = {name for _, expr, _ in queries for name in re.findall(r"rankwatch_\w+", expr)}
    assert {"rankwatch_alert_firing", "rankwatch_rollup_mean", "rankwatch_rollup_p99",
            "rankwatch_rollup_nonfinite", "rankwatch_rollup_last_step"} <= used


def test_the_dashboard_check_fails_on_a_missing_series_label_or_value(exported):
    assert query_problems('rankwatch_rollup_median{run=~"$run"}', exported)  # no such series
    assert query_problems('rankwatch_rollup_mean{host="a"}', exported)  # no such label
    assert query_problems('rankwatch_rollup_mean{rank="merged"}', exported)  # no such value
    assert query_problems('sum by (node) (rankwatch_rollup_mean)', exported)  # grouping on a missing label
    assert query_problems("rankwatch_rollup_mean", exported, legend="{{host}}")  # legend on a missing label
    assert query_problems('{__name__="rankwatch_rollup_mean"}', exported)  # unchecked form
    assert not query_problems('max by (run) (rankwatch_rollup_last_step{run=~"${run}", rank="all"}) or vector(0)',
                              exported, legend="{{run}}")
