"""``rankwatch report --html``: a run from the real worker on the embedded broker, the report store the
stack fills, the page rendered in headless Chromium: every chart drew and the page logged no error."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from browser import console_errors, render
from rankwatch.cli import main
from rankwatch.sim_runs import TrainingRun, send
from rankwatch.sinks.report_data import heatmap
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_query import Filters, Queries

pytestmark = pytest.mark.broker


def wait_for(check, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.5)
    return check()


def stored_run(stack, run: TrainingRun) -> Queries:
    """Send the run through the stack's broker and worker; wait until the store has all of it."""
    send(stack.bootstrap, run.records())
    q = Queries(ReportStore(str(Path(stack.settings.data_dir) / "store.db")).db)
    evals = run.steps // run.eval_every
    last_window = run.steps // stack.settings.rollup_steps * stack.settings.rollup_steps

    def complete():
        done = [r for r in q.eval_reports(run.run) if r.complete and not r.provisional]
        ends = q.rollups(run.run, Filters(metric="compute_time_s", steps=(last_window, None)))
        return len(done) == evals and len({r["rank"] for r in ends}) > run.ranks  # every rank, and run-wide

    assert wait_for(complete), f"the store did not get the whole run {run.run}"
    return q


def test_html_report_draws_every_chart_in_a_real_browser(stack, run_id, tmp_path, capsys):
    run = TrainingRun(run=run_id, ranks=4, steps=200, straggler=2, nan_step=95, inconsistent_rank=3)
    q = stored_run(stack, run)
    assert wait_for(lambda: {a["detector"] for a in q.alerts(run_id)} >= {"nonfinite", "eval_consistency"}, 30)

    page = tmp_path / "report.html"
    url = str(Path(stack.settings.data_dir) / "store.db")
    assert main(["report", "--run", run_id, "--html", str(page), "--store", url]) == 0
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?https?:""", text)  # self-contained: nothing to fetch

    dom, log = render(page)
    charts = re.findall(r'<div class="chart" id="(chart\d+)" data-kind="(\w+)" data-drawn="([^"]*)"', dom)
    kinds = {k for _, k, _ in charts}
    assert kinds == {"line", "heat", "timeline"} and all(d == "1" for _, _, d in charts), charts
    assert re.search(r'<body data-charts="(\d+)" data-drawn="\1"', dom)
    assert '<ul id="errors"></ul>' in dom and not console_errors(log), console_errors(log)
    # eval metrics with bands, the training curves, per-rank lines, the heatmap, the timeline, consistency
    for title in ("eval correct (95% CI)", "eval reward (95% CI)", "loss (", "grad_norm", "reward",
                  "compute_time_s per rank", "samples_per_s per rank", "compute_time_s: rank × step"):
        assert f">{title}" in dom, title
    assert re.search(r">\d+ alert transitions<", dom)
    assert dom.count("<polygon") >= 2  # the CI bands
    # The look ahead: the loss levelled off; the last evaluation fell (rank 3 drags its mean down).
    assert 'id="forecasts"' in dom and "training loss: plateau reached around step" in dom
    assert "eval correct falling, collapse risk" in dom
    assert 'class="marker"' in dom  # the NaN's alert on the loss curve
    assert re.search(r"rank 3</td>.*?differs: correct", dom, re.S)  # the rank the consistency test named
    assert "rank 0</td>" in dom and re.search(r"rank 0</td>(?:(?!</tr>).)*consistent", dom, re.S)

    # The straggler is a stripe: rank 2's cells stand out in every window, with step time over compute time.
    hm = heatmap(q.rollups(run_id), "compute_time_s")
    row = hm["ratio"][hm["ranks"].index(2)]
    assert all(r > 1.4 for r in row if r == r), row
    assert all(r < 1.1 for i, other in enumerate(hm["ratio"]) if hm["ranks"][i] != 2 for r in other if r == r)
