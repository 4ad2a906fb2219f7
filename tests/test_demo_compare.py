"""Issue 21's "done when": ``--compare`` on two demo runs with different learning rates. The real demo,
twice, as a user runs it (each on its own embedded broker, both into the report store of one data dir), then
``rankwatch report --compare`` as JSON and as an HTML page."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

RANKWATCH = [sys.executable, "-m", "rankwatch"]

pytestmark = pytest.mark.broker


def _demo(lr: float, cwd, env) -> str:
    """One short demo run without a fault: 2 ranks, 40 steps (evaluations at 0 and 40); its run id."""
    done = subprocess.run([*RANKWATCH, "demo", "--ranks", "2", "--steps", "40", "--nan-step", "-1", "--lr", str(lr)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"lr {lr:g}, no fault injected" in done.stdout and "eval at step   40" in done.stdout, done.stdout
    return re.search(r"^rankwatch demo: run (\S+),", done.stdout, re.M)[1]


def test_compare_two_demo_runs_with_different_learning_rates(tmp_path):
    env = dict(os.environ, RANKWATCH_DATA_DIR=str(tmp_path / "data"))
    for name in ("RANKWATCH_BOOTSTRAP", "RANKWATCH_STORE_URL", "RANKWATCH_EVAL_COMPOSITE"):
        env.pop(name, None)  # the embedded broker, the data dir's store, the default composite (correct=1)
    fast, slow = _demo(0.1, tmp_path, env), _demo(0.005, tmp_path, env)
    assert fast.startswith("demo-") and slow.startswith("demo-") and slow.endswith("-lr0.005") and fast != slow

    def rankwatch(*args: str) -> str:
        done = subprocess.run([*RANKWATCH, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    stored = {r["run"]: r for r in json.loads(rankwatch("runs", "--json"))}
    assert {fast, slow} <= set(stored) and stored[fast]["world_size"] == stored[slow]["world_size"] == 2

    out = json.loads(rankwatch("report", "--compare", slow, fast, "--json"))
    assert out["runs"] == [slow, fast]
    for run in (fast, slow):  # each run's evaluations: before training and of the final weights, all 500 samples
        summary = out["summaries"][run]
        assert summary["steps"] == [0, 40] and {"correct", "loss"} <= set(summary["metrics"])
        final = summary["metrics"]["correct"]["final"]
        assert (final["step"], final["n"]) == (40, 500) and 0.0 < final["mean"] < 1.0
    final = {run: out["summaries"][run]["metrics"]["correct"]["final"]["mean"] for run in (fast, slow)}
    assert final[fast] > final[slow] + 0.1  # lr 0.1 learns digits in 40 steps; lr 0.005 is far behind
    assert (out["ranked_by"], out["ranking"]) == ("composite", [fast, slow])
    assert out["tests"]["correct"]["leader"] == fast and out["tests"]["loss"]["leader"] == fast
    [vs] = out["tests"]["correct"]["vs"]
    assert vs["run"] == slow and vs["significant"] and vs["p_holm"] < 0.05
    assert out["verdict"].startswith(f"{fast} did best on the composite score")
    assert f"on correct significantly better than {slow}" in out["verdict"]

    page = tmp_path / "compare.html"
    rankwatch("report", "--compare", fast, slow, "--html", str(page))
    text = page.read_text(encoding="utf-8")
    table = re.search(r'<table id="comparison">(.*?)</table>', text, re.S)[1]
    rows = re.findall(r'<tr><td class="l">([^<]+)</td><td class="l">([^<]+)</td><td>([0-9.]+) ', table)
    assert {(m, r) for m, r, _ in rows} == {(m, r) for m in ("correct", "loss") for r in (fast, slow)}
    shown = {r: float(v) for m, r, v in rows if m == "correct"}
    assert shown == pytest.approx(final, abs=1e-3)
    assert f"rankwatch compare: {fast} vs {slow}" in text and "eval correct (95% CI)" in text
