"""A job killed and resumed from an earlier checkpoint on fewer nodes (an elastic restart), the whole
loop on the embedded broker: real torch ranks as separate processes, the worker, the alert and
report topics."""

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
WORLD, RESUMED_WORLD, SAVE_AT, DIED_AT, LAST, STEP_S = 2, 1, 10, 149, 170, 0.08
WIDTH = 10  # the test stack's rollup_steps


def _ranks(run_id: str, bootstrap: str, tmp_path: Path, world: int) -> None:
    """``world`` ranks: from step 0 until they die, or from their checkpoint to the end."""
    procs = [subprocess.Popen([sys.executable, str(HERE / "resume_loop.py"), run_id, bootstrap,
                               str(tmp_path / f"rank{r}.pt"), str(SAVE_AT), str(DIED_AT if died else LAST), str(STEP_S)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)))
             for r in range(world) for died in [not (tmp_path / f"rank{r}.pt").exists()]]
    assert [p.wait(120) for p in procs] == [0] * world


def test_a_job_resumed_from_an_earlier_checkpoint_on_fewer_nodes_raises_nothing_and_its_reports_follow_it(
        bootstrap, run_id, tmp_path):
    # Rank 0 repeats steps 11-149 for 11 s, beyond the stall floor of 10 s, and its loss goes back
    # up; rank 1's node is gone, and the job resumes without it.
    _ranks(run_id, bootstrap, tmp_path, WORLD)
    _ranks(run_id, bootstrap, tmp_path, RESUMED_WORLD)
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
    # What a restart could raise: a stall, a jump of the loss or grad norm, a gone rank's stall. A
    # rank descheduled twice running on a loaded machine may still be a straggler: not this test's.
    assert [(a["detector"], a["metric"], a["status"], a["step"], a["message"]) for a in alerts
            if (a["detector"], a["metric"]) != ("crossrank", "compute_time_s")] == []
