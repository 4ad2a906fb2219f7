"""A job killed and resumed from an earlier checkpoint, the whole loop on the embedded broker: real
torch ranks as separate processes, the worker, the alert and report topics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import consume_json

from rankwatch import contract

pytestmark = pytest.mark.broker
HERE = Path(__file__).parent
WORLD, SAVE_AT, DIED_AT, LAST, STEP_S = 2, 10, 149, 170, 0.08
WIDTH = 10  # the test stack's rollup_steps


def _ranks(run_id: str, bootstrap: str, tmp_path: Path) -> None:
    """Every rank once: from step 0 until it dies, or from the checkpoint to the end."""
    procs = [subprocess.Popen([sys.executable, str(HERE / "resume_loop.py"), run_id, bootstrap,
                               str(tmp_path / f"rank{r}.pt"), str(SAVE_AT), str(DIED_AT if died else LAST), str(STEP_S)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD)))
             for r in range(WORLD) for died in [not (tmp_path / f"rank{r}.pt").exists()]]
    assert [p.wait(120) for p in procs] == [0] * WORLD


def test_a_job_resumed_from_an_earlier_checkpoint_raises_nothing_and_its_reports_follow_the_resumed_run(
        bootstrap, run_id, tmp_path):
    # The ranks repeat steps 11-149 for 11 s, beyond the stall floor of 10 s; the loss goes back up.
    _ranks(run_id, bootstrap, tmp_path)
    _ranks(run_id, bootstrap, tmp_path)
    last_window = LAST // WIDTH * WIDTH
    rollups = consume_json(bootstrap, contract.REPORTS,
                           lambda r: r.get("run") == run_id and r.get("metric") == "loss" and r.get("rank") == 0,
                           until=lambda found: any(r["start_step"] == last_window for r in found))
    latest = {r["start_step"]: r for r in rollups}  # the store keeps the last one sent per window
    assert sorted(latest) == list(range(0, last_window + 1, WIDTH))
    # The window of the checkpoint holds the resumed steps after it; the others every step once.
    assert (latest[10]["first_step"], latest[10]["count"]) == (SAVE_AT + 1, 9)
    assert {s: r["count"] for s, r in latest.items() if s not in (10, last_window)} == {
        s: WIDTH for s in latest if s not in (10, last_window)}
    alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id, timeout_s=5,
                          until=lambda found: False)
    assert [(a["detector"], a["metric"], a["status"], a["step"], a["message"]) for a in alerts] == []
