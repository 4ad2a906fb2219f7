"""The trainer adapters under DDP: two real ranks (gloo, CPU, separate processes), one of them slow.

Every rank's step lasts as long as the slowest one's, because the others wait for it in DDP's
gradient all-reduce; only ``compute_time_s`` (the step less its collective time) names the slow
rank, and only if the hook times that all-reduce although the trainer hands the callback the
model inside its ``DistributedDataParallel`` wrapper. The timing tests publish into a recording
double; the last test publishes to the session's broker and waits for the worker's alert.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from conftest import consume_json

from rankwatch import contract

WORLD, SLOW_RANK, SLOW_S, STEPS = 2, 1, 0.15, 10


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


def _slow_down(rank: int, training: bool) -> None:
    if rank == SLOW_RANK and training:
        time.sleep(SLOW_S)  # before the backward: the peer waits for it in the all-reduce


def _lightning(rank: int, publisher: RecordingPublisher) -> None:
    import lightning.pytorch as L

    from rankwatch.producers.adapters.lightning import RankwatchCallback

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            _slow_down(rank, True)
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=STEPS, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[RankwatchCallback(publisher, every=1)],
    )
    trainer.fit(Regression(), torch.utils.data.DataLoader(_Pairs(), batch_size=4))


def _huggingface(rank: int, publisher: RecordingPublisher, out_dir: str) -> None:
    from transformers import Trainer, TrainingArguments

    from rankwatch.producers.adapters.huggingface import RankwatchCallback

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            _slow_down(rank, self.training)
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=STEPS, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, logging_steps=STEPS, dataloader_num_workers=0,
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=_Pairs(),
                      callbacks=[RankwatchCallback(publisher, every=1)])
    trainer.train()


def _rank_main(trainer: str, rank: int, port: int, out_dir: str, results) -> None:
    # Configured by the environment only, as torchrun does; LOCAL_RANK tells Lightning not to launch.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    publisher = RecordingPublisher()
    try:
        if trainer == "lightning":
            _lightning(rank, publisher)
        else:
            _huggingface(rank, publisher, out_dir)
        results.put((rank, publisher.points, None))
    except BaseException as exc:  # the parent reports it: a dead rank would otherwise only time out
        results.put((rank, publisher.points, repr(exc)))
        raise


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("trainer", ["lightning", "huggingface"])
def test_the_slow_rank_computes_longer_and_its_peer_waits_in_the_all_reduce(trainer, tmp_path):
    import torch.multiprocessing as mp

    from rankwatch.broker import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(trainer, r, port, str(tmp_path), results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = {rank: (points, error) for rank, points, error in (results.get(timeout=90) for _ in procs)}
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert {r: error for r, (_, error) in got.items()} == {0: None, 1: None}

    def median(rank: int, metric: str) -> float:
        points = got[rank][0]
        values = [points[s][metric] for s in sorted(points)[2:] if metric in points[s]]  # past the warm-up
        assert len(values) >= STEPS - 4, (rank, metric, points)
        return statistics.median(values)

    fast = 1 - SLOW_RANK
    compute = {r: median(r, "compute_time_s") for r in range(WORLD)}
    waited = {r: median(r, "collective_time_s") for r in range(WORLD)}
    # The fast rank spends the slow one's extra time waiting in the all-reduce, not computing.
    assert waited[fast] > SLOW_S * 0.6 > waited[SLOW_RANK], (compute, waited)
    assert compute[SLOW_RANK] > SLOW_S * 0.8 and compute[SLOW_RANK] > compute[fast] + SLOW_S * 0.5, (compute, waited)


# Lightning under DDP against the real broker and worker. With two ranks the cross-rank detector
# cannot tell from one step which rank is off (both sit equally far from their midpoint), so it
# also asks each rank's own history: rank 1 must first run like rank 0 for the warm-up (10 steps),
# then slow down. Each slow step adds min(z - 3, 5) to rank 1's CUSUM, which fires at 10.
ALERT_STEPS, SLOW_FROM = 30, 15


def _lightning_to_broker(rank: int, port: int, run: str, bootstrap: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANKWATCH_RUN=run,
                      RANKWATCH_BOOTSTRAP=bootstrap)
    torch.set_num_threads(1)
    try:
        import lightning.pytorch as L

        from rankwatch.producers.adapters.lightning import RankwatchCallback

        class Regression(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                _slow_down(rank, self.global_step >= SLOW_FROM)
                return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=ALERT_STEPS, enable_checkpointing=False,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[RankwatchCallback(every=1)],  # its own publisher, from the environment
        )
        trainer.fit(Regression(), torch.utils.data.DataLoader(_Pairs(), batch_size=4))
        results.put((rank, None))
    except BaseException as exc:
        results.put((rank, repr(exc)))
        raise


@pytest.mark.broker
@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_a_straggler_alert_names_the_slow_rank_under_lightning_ddp(bootstrap, run_id):
    import torch.multiprocessing as mp

    from rankwatch.broker import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_lightning_to_broker, args=(r, port, run_id, bootstrap, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        errors = dict(results.get(timeout=180) for _ in procs)  # ~30 s here; a loaded CI machine is slower
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert errors == {0: None, 1: None}
    alerts = consume_json(bootstrap, contract.ALERTS,
                          lambda a: a["run"] == run_id and a["detector"] == "crossrank", timeout_s=30)
    assert alerts, "no straggler alert"
    # Named by its own compute time, or by its peer's wait in the all-reduce (whichever rule is first),
    # possibly both on one page.
    named_by = {alerts[0]["metric"], *alerts[0].get("metrics", [])}
    assert named_by <= {"compute_time_s", "collective_time_s"}, alerts[0]
    assert (alerts[0]["ranks"], alerts[0]["status"]) == ([SLOW_RANK], "firing")
    assert alerts[0]["step"] >= SLOW_FROM
