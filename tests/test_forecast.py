"""Forecasts: the pure fit on shapes with a known answer, and a collapsing run through the real worker,
seen by ``rankwatch report --forecast``, the HTTP API and the HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rankwatch.cli import main
from rankwatch.forecast import direction_of, forecast
from rankwatch.sim_runs import TrainingRun

STEPS = np.arange(0, 500, 20)


def noisy(y, seed, sd=0.01):
    return y + np.random.default_rng(seed).normal(0.0, sd, np.size(y))


def test_plateau_step_is_found_early_and_close():
    truth = 100 * np.log(20)  # 0.9 - 0.7·exp(-step/100) has closed 95% of its rise here: step 300
    acc = 0.9 - 0.7 * np.exp(-STEPS / 100)
    for seed in range(5):
        f = forecast("accuracy", STEPS[:9], noisy(acc[:9], seed))  # up to step 160, before the plateau
        assert f["kind"] == "plateau" and abs(f["plateau_step"] - truth) < 0.25 * truth, f["verdict"]
        assert f["verdict"].startswith("accuracy: plateau expected around step")
    done = forecast("accuracy", STEPS, noisy(acc, 0))
    assert done["verdict"].startswith("accuracy: plateau reached around step")


def test_collapse_is_called_and_a_healthy_plateau_is_not():
    acc = 0.9 - 0.7 * np.exp(-STEPS / 60)
    falling = acc.copy()
    falling[-4:] -= [0.03, 0.08, 0.14, 0.2]
    f = forecast("reward", STEPS, noisy(falling, 1))
    assert f["kind"] == "collapse" and f["verdict"].startswith("reward falling, collapse risk")
    loss = forecast("loss", STEPS, noisy(0.3 + 2 * np.exp(-STEPS / 60) + np.r_[np.zeros(21), 0.2, 0.5, 0.9, 1.4], 2))
    assert loss["kind"] == "collapse" and "rising, divergence risk" in loss["verdict"]
    demo = forecast("correct", [0, 40, 80, 120, 160, 200], [0.092, 0.876, 0.890, 0.912, 0.100, 0.100])
    assert demo["kind"] == "collapse" and "lost 99% of its gain since step 120" in demo["verdict"]  # the demo's NaN
    false_alarms = sum(forecast("reward", STEPS, noisy(acc, seed))["kind"] == "collapse" for seed in range(40))
    assert false_alarms <= 2  # the band is 95%: about one point in twenty-ish may fall out by chance


def test_band_covers_the_future_and_edge_cases():
    acc = 0.9 - 0.7 * np.exp(-STEPS / 100)
    f = forecast("accuracy", STEPS[:12], noisy(acc[:12], 3))
    x, lo, hi = np.array(f["steps"]), np.array(f["lo"]), np.array(f["hi"])
    assert x.max() > STEPS[11] and np.all(lo <= hi)
    future = np.interp(STEPS[12:17], x, lo), np.interp(STEPS[12:17], x, hi)
    assert np.all((future[0] <= acc[12:17]) & (acc[12:17] <= future[1]))  # the true curve stays in the band
    assert forecast("accuracy", [0, 10, 20], [0.1, 0.2, 0.3])["kind"] == "insufficient"
    assert forecast("reward", STEPS, STEPS * 0.01)["kind"] == "improving"
    assert forecast("grad_norm", STEPS, noisy(1 + np.exp(-STEPS / 50), 4))["kind"] == "plateau"  # no direction
    assert (direction_of("eval_loss"), direction_of("reward"), direction_of("grad_norm")) == ("lower", "higher", None)


@pytest.mark.broker
def test_a_collapsing_run_is_called_in_the_cli_the_api_and_the_page(stack, run_id, tmp_path, capsys):
    from browser import console_errors, render
    from rankwatch.sinks.api import ReportAPI
    from test_html_report import stored_run

    stored_run(stack, TrainingRun(run=run_id, ranks=2, steps=240, eval_every=20, collapse_step=160))
    url = str(Path(stack.settings.data_dir) / "store.db")
    assert main(["report", "--run", run_id, "--forecast", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("eval correct falling, collapse risk") for line in lines), lines
    assert any(line.startswith("training reward falling, collapse risk") for line in lines), lines
    assert any(line.startswith("training loss") for line in lines)  # a rule watches the loss

    status, _, body = ReportAPI(url, rules=stack.settings.rules).get(f"/runs/{run_id}/forecast", {})
    served = json.loads(body)
    assert status == 200 and served["eval"]["correct"]["kind"] == "collapse"
    assert "compute_time_s" not in served["training"]  # only cross-rank rules name it: no trend to forecast

    page = tmp_path / "r.html"
    assert main(["report", "--run", run_id, "--html", str(page), "--store", url]) == 0
    dom, log = render(page)
    assert 'id="forecasts"' in dom and "eval correct falling, collapse risk" in dom
    assert ">eval correct (95% CI): correct falling, collapse risk" in dom
    assert 'data-drawn="error"' not in dom and '<ul id="errors"></ul>' in dom and not console_errors(log)
