"""A DDP job that stops: the stall alert names the rank the others wait for.

A real 3-rank gloo job with the real hook and publisher, the embedded broker and the session's
worker; only the user's side of the alert topic is read.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import consume_json

from rankwatch.producers import RankPublisher, TrainerHook
from rankwatch import contract

pytestmark = pytest.mark.broker

WORLD, HUNG = 3, 2
STEPS, HANG_AT, HANG_S = 30, 20, 18.0  # the stall bound is at least 10 s


def _rank_main(rank: int, port: int, bootstrap: str, run: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANKWATCH_RUN=run, RANKWATCH_BOOTSTRAP=bootstrap)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    # Frequent batches and heartbeats: the stall detector learns the pace within the 20 steps.
    publisher = RankPublisher.from_env(samplers=[], heartbeat_s=0.5, linger_s=0.1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    TrainerHook(model, opt, publisher)
    for step in range(STEPS):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        if rank == HUNG and step == HANG_AT:
            time.sleep(HANG_S)  # stuck outside any collective; its peers wait in the all-reduce
        loss.backward()
        opt.step()
        time.sleep(0.1)  # a steady pace, from which the stall detector learns what a gap is
    publisher.close()
    torch.distributed.destroy_process_group()


def test_a_hung_rank_in_a_ddp_job_is_named_and_its_waiting_peers_are_not(bootstrap, run_id):
    import torch.multiprocessing as mp

    from rankwatch.broker import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, bootstrap, run_id)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WORLD

    def stall(a: dict) -> bool:
        return a["run"] == run_id and a["detector"] == "stall"

    alerts = consume_json(bootstrap, contract.ALERTS, stall, count=2, timeout_s=20)
    assert [a["status"] for a in alerts] == ["firing", "resolved"], alerts
    firing, resolved = alerts
    assert (firing["status"], firing["ranks"], firing["step"]) == ("firing", [HUNG], HANG_AT - 1), firing
    assert "ranks 0, 1 blocked in a collective" in firing["message"]
    assert (resolved["status"], resolved["ranks"]) == ("resolved", [HUNG])
    assert len(consume_json(bootstrap, contract.ALERTS, stall, count=3, timeout_s=2)) == 2
