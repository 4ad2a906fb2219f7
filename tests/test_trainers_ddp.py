"""The trainers under DDP: two real ranks (gloo, CPU, separate processes), one of them slow.

Every rank's step lasts as long as the slowest one's, because the others wait for it in DDP's
gradient all-reduce; only ``compute_time_s`` (the step less its collective time) names the slow
rank, and only if the hook times that all-reduce although the trainer hands the callback the
model inside its ``DistributedDataParallel`` wrapper. The timing tests publish into a recording
double; the alert tests publish to the session's broker and wait for the worker's alert, under
Lightning, the Hugging Face Trainer, and a plain torch loop with ``TrainerHook``.

Each rank is a process of its own, configured only by the environment torchrun gives it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from typing import Any

import pytest
import torch
from conftest import consume_json

from rankwatch import contract

WORLD, SLOW_RANK, SLOW_S = 2, 1, 0.15


class RecordingPublisher:
    """The parts of ``RankPublisher`` the hook uses; keeps what it would publish, as floats."""

    def __init__(self) -> None:
        self.points: dict[int, dict[str, float]] = {}

    def log(self, metrics, step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self.points.setdefault(step, {})[name] = float(value)

    def defer(self, build, *args) -> None:
        self.log(*reversed(build(*args)))

    def add_sampler(self, sampler) -> None:
        pass

    def wake(self) -> None:
        pass

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True


class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64 * WORLD

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "y": torch.randn(1, generator=g)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each rank runs: ``steps`` optimizer steps, where rank SLOW_RANK sleeps ``slow_s`` more
    per step from the step published as ``slow_from`` on (each trainer's own numbering)."""

    steps: int
    slow_from: int
    slow_s: float
    out_dir: str

    def at(self, rank: int, step: int) -> None:
        """Called before the backward of ``step``: the peer waits for the slow rank in the all-reduce."""
        if rank == SLOW_RANK and step >= self.slow_from:
            time.sleep(self.slow_s)


# Each trainer: one rank's whole training under ``plan``. Without a publisher, the trainer's rankwatch
# makes its own from the environment (RANKWATCH_RUN, RANKWATCH_BOOTSTRAP), as a user's would.


def _lightning(rank: int, publisher: Any, plan: Plan) -> None:
    import lightning.pytorch as L

    from rankwatch.producers.adapters.lightning import RankwatchCallback

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            plan.at(rank, self.global_step)  # Lightning publishes its first update as step 0
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=plan.steps, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[RankwatchCallback(publisher, every=1)],
    )
    trainer.fit(Regression(), torch.utils.data.DataLoader(_Pairs(), batch_size=4))


def _huggingface(rank: int, publisher: Any, plan: Plan) -> None:
    from transformers import Trainer, TrainingArguments

    from rankwatch.producers.adapters.huggingface import RankwatchCallback

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.steps = 0  # training forwards: one per optimizer step here

        def forward(self, x, y):
            if self.training:
                self.steps += 1  # Hugging Face publishes its first update as step 1
                plan.at(rank, self.steps)
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    args = TrainingArguments(
        output_dir=plan.out_dir, per_device_train_batch_size=4, max_steps=plan.steps, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, logging_steps=plan.steps, dataloader_num_workers=0,
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=_Pairs(),
                      callbacks=[RankwatchCallback(publisher, every=1)])
    trainer.train()


def _torch(rank: int, publisher: Any, plan: Plan) -> None:
    # A plain loop as a user writes it under torchrun: README's example with the model in DDP.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rankwatch.producers import RankPublisher, TrainerHook

    dist.init_process_group("gloo")  # from torchrun's environment
    try:
        model = DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        own = publisher is None
        publisher = RankPublisher.from_env() if own else publisher
        hook = TrainerHook(model, optimizer, publisher, every=1)
        data = _Pairs()
        loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(data))
        epochs = itertools.chain.from_iterable(itertools.repeat(loader))
        for step, batch in enumerate(itertools.islice(hook.wrap_loader(epochs), plan.steps)):
            plan.at(rank, step)  # the hook publishes the first update as step 0
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            hook.set_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
        if own:
            publisher.close()
    finally:
        dist.destroy_process_group()


TRAINERS = {"lightning": _lightning, "huggingface": _huggingface, "torch": _torch}


def _rank_main(trainer: str, rank: int, port: int, env: dict[str, str], record: bool, plan: Plan, results) -> None:
    # Configured by the environment only, as torchrun does; LOCAL_RANK tells Lightning not to launch.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
    publisher = RecordingPublisher() if record else None
    try:
        TRAINERS[trainer](rank, publisher, plan)
        results.put((rank, publisher and publisher.points, None))
    except BaseException as exc:  # the parent reports it: a dead rank would otherwise only time out
        results.put((rank, publisher and publisher.points, repr(exc)))
        raise


def run_ranks(trainer: str, plan: Plan, *, env: dict[str, str] | None = None,
              record: bool = False) -> dict[int, tuple[dict | None, str | None]]:
    """Two ranks of ``trainer`` in processes of their own: per rank, what it recorded and its error (or None)."""
    import torch.multiprocessing as mp

    from rankwatch.broker import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(trainer, r, port, env or {}, record, plan, results))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        # Mostly imports (torch, the trainer), then a few seconds of steps; a loaded CI machine is much slower.
        got = {rank: (points, error) for rank, points, error in (results.get(timeout=240) for _ in procs)}
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return got


TIMING_STEPS = 10


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("trainer", ["lightning", "huggingface"])
def test_the_slow_rank_computes_longer_and_its_peer_waits_in_the_all_reduce(trainer, tmp_path):
    got = run_ranks(trainer, Plan(TIMING_STEPS, slow_from=0, slow_s=SLOW_S, out_dir=str(tmp_path)), record=True)
    assert {r: error for r, (_, error) in got.items()} == {0: None, 1: None}

    def median(rank: int, metric: str) -> float:
        points = got[rank][0]
        values = [points[s][metric] for s in sorted(points)[2:] if metric in points[s]]  # past the warm-up
        assert len(values) >= TIMING_STEPS - 4, (rank, metric, points)
        return statistics.median(values)

    fast = 1 - SLOW_RANK
    compute = {r: median(r, "compute_time_s") for r in range(WORLD)}
    waited = {r: median(r, "collective_time_s") for r in range(WORLD)}
    # The fast rank spends the slow one's extra time waiting in the all-reduce, not computing.
    assert waited[fast] > SLOW_S * 0.6 > waited[SLOW_RANK], (compute, waited)
    assert compute[SLOW_RANK] > SLOW_S * 0.8 and compute[SLOW_RANK] > compute[fast] + SLOW_S * 0.5, (compute, waited)


# Against the real broker and worker. With two ranks the cross-rank detector cannot tell from one
# step which rank is off (both sit equally far from their midpoint), so it also asks each rank's
# own history: rank 1 must first run like rank 0 for the warm-up (10 steps), then slow down. Each
# slow step adds min(z - 3, 5) to rank 1's CUSUM, which fires at 10.
#
# That history is the rank's own step timing, and a loaded machine bends it: on 2 cores at load 10
# a Hugging Face rank's warm-up compute_time_s ran 0.03-0.2 s where it is 3-10 ms on an idle one (its
# step is mostly Python that waits for a core), so 0.15 s more per step was no outlier and, rightly,
# raised nothing. The injected straggler is sized above that noise: 0.5 s a step.
ALERT_STEPS, SLOW_FROM, STRAGGLER_S = 30, 15, 0.5
TIMING_METRICS = {"compute_time_s", "collective_time_s"}


@pytest.mark.broker
@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("trainer", ["lightning", "huggingface", "torch"])
def test_a_straggler_alert_names_the_slow_rank_under_ddp(trainer, bootstrap, run_id, tmp_path):
    env = {"RANKWATCH_RUN": run_id, "RANKWATCH_BOOTSTRAP": bootstrap}
    got = run_ranks(trainer, Plan(ALERT_STEPS, SLOW_FROM, STRAGGLER_S, str(tmp_path)), env=env)
    assert {r: error for r, (_, error) in got.items()} == {0: None, 1: None}

    def straggler(alert: dict) -> bool:
        return alert["run"] == run_id and alert["detector"] == "crossrank"

    # Every straggler alert of the run up to and including the first that names the slow rank.
    alerts = consume_json(bootstrap, contract.ALERTS, straggler, timeout_s=60,
                          until=lambda found: any(SLOW_RANK in a["ranks"] for a in found))
    assert alerts, "no straggler alert"
    assert [a["ranks"] for a in alerts] == [[SLOW_RANK]] * len(alerts), alerts  # never the fast rank
    first = alerts[0]
    # Named by its own compute time, or by its peer's wait in the all-reduce (whichever rule is first),
    # possibly both on one page.
    assert {first["metric"], *first.get("metrics", [])} <= TIMING_METRICS, first
    assert first["status"] == "firing" and first["step"] >= SLOW_FROM, first
