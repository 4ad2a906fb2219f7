"""``rankwatch report --compare``: two runs through the real worker that differ only in learning rate; the
faster one wins, significantly, and the comparison page draws every chart in headless Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from browser import console_errors, render
from rankwatch.cli import main
from rankwatch.sim_runs import TrainingRun
from rankwatch.sinks.compare import holm, lower_is_better
from test_html_report import stored_run

pytestmark = pytest.mark.broker


def test_compare_two_learning_rates(stack, run_id, tmp_path, capsys):
    fast, slow = f"{run_id}-lr0.1", f"{run_id}-lr0.02"
    for name, lr in ((fast, 0.1), (slow, 0.02)):
        stored_run(stack, TrainingRun(run=name, lr=lr, ranks=2, steps=120, eval_every=30, seed=1))
    url = str(Path(stack.settings.data_dir) / "store.db")

    assert main(["report", "--compare", slow, fast, "--json", "--store", url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranking"] == [fast, slow] and out["ranked_by"] == "composite"  # the suite's settings weight correct
    correct = out["tests"]["correct"]
    assert correct["leader"] == fast and correct["vs"][0]["run"] == slow and correct["vs"][0]["significant"]
    final = {r: out["summaries"][r]["metrics"]["correct"]["final"] for r in (fast, slow)}
    assert final[fast]["step"] == final[slow]["step"] == 120 and final[fast]["mean"] > final[slow]["mean"] + 0.1
    assert out["summaries"][fast]["metrics"]["correct"]["best"]["mean"] >= final[fast]["mean"]
    assert fast in out["verdict"] and f"on correct significantly better than {slow}" in out["verdict"]

    assert main(["report", "--compare", fast, slow, "--store", url]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"runs ranked by composite: {fast} > {slow}") and " *" in text

    page = tmp_path / "compare.html"
    assert main(["report", "--run", fast, "--compare", slow, "--html", str(page), "--store", url]) == 0
    dom, log = render(page)
    charts = re.findall(r'<div class="chart" id="chart\d+" data-kind="line" data-drawn="([^"]*)"', dom)
    assert len(charts) >= 2 + 4 and set(charts) == {"1"}  # correct, reward; loss, grad_norm, lr, reward, …
    assert '<ul id="errors"></ul>' in dom and not console_errors(log)
    assert ">eval correct (95% CI)<" in dom and ">lr<" in dom and 'id="comparison"' in dom


def test_compare_needs_two_runs(stack, capsys):
    url = str(Path(stack.settings.data_dir) / "store.db")
    assert main(["report", "--compare", "only-one", "--store", url]) == 2
    assert "two runs" in capsys.readouterr().err


def test_direction_and_holm():
    assert lower_is_better("eval_loss") and not lower_is_better("reward")
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
