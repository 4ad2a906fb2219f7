"""TrainerHook on real torch loops: what reaches the topic is what the loop computed."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Iterator

import pytest
import torch
from conftest import DEVICES, consume_json, sharing_a_cpu

import rankwatch.producers as producers
from rankwatch.producers import RankPublisher, TrainerHook
from rankwatch.producers.grad_norms import count_nonfinite
from rankwatch import contract
from rankwatch.contract import HEARTBEAT

pytestmark = pytest.mark.broker


def read_series(bootstrap: str, run: str, sent: int) -> dict[tuple[int, str], list[tuple[int, float]]]:
    """Every (step, value) per (rank, metric) of ``run``, from ``sent`` messages, in send order.
    ``sent`` counts the NaN lane's messages too (``rankwatch.urgent``), already on the broker."""
    lane = consume_json(bootstrap, contract.URGENT, lambda b: b.get("run") == run, count=sent, timeout_s=3)
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run, count=sent - len(lane))
    assert len(batches) + len(lane) == sent
    out: dict[tuple[int, str], list[tuple[int, float]]] = defaultdict(list)
    for batch in sorted(batches, key=lambda b: (b["rank"], b["seq"])):
        for name, series in batch["series"].items():
            values = [contract.decode_float(v) for v in series["values"]]
            out[(batch["rank"], name)] += list(zip(series["steps"], values))
    return out


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _total_norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])).item()


@contextlib.contextmanager
def _device_waits_in_rankwatch(device: str) -> Iterator[list[str]]:
    """Yields the list of the calls from rankwatch's code (``producers``) that made this thread wait
    for a CUDA device, found by CUDA's sync debug mode; the loop's own waits do not count."""
    waits: list[str] = []
    if torch.device(device).type != "cuda":  # a CPU tensor is on the host already: nothing to wait for
        yield waits
        return
    thread, ours = threading.get_ident(), os.path.dirname(producers.__file__)

    def show(message, category, filename, lineno, file=None, line=None):
        if threading.get_ident() == thread and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(ours)]
            if frames:
                waits.append(f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
def test_published_values_equal_what_the_loop_computed(bootstrap, run_id, device):
    torch.manual_seed(1)
    model = _net().to(device)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}], lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap)
    hook = TrainerHook(model, opt, publisher, samples_per_step=32, weight_stats_every=2, every=1)
    batches = [torch.randn(32, 6) for _ in range(6)]
    batches[4][0, 0] = float("nan")
    with _device_waits_in_rankwatch(device) as waits:  # the detector works: a CUDA value read in our code
        count_nonfinite([torch.ones((), device=device)])
    assert len(waits) == (device == "cuda")
    expected = defaultdict(dict)
    with _device_waits_in_rankwatch(device) as waits:
        for step, x in enumerate(hook.wrap_loader([b.to(device) for b in batches])):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            expected["grad_norm"][step] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
            expected["grad_nonfinite"][step] = float(sum(not torch.isfinite(p.grad).all() for p in model.parameters()))
            expected["loss"][step] = loss.item()
            expected["lr"][step], expected["lr/group1"][step] = (g["lr"] for g in opt.param_groups)
            hook.set_loss(loss, reward=2.0 * step)
            train_step_s = torch.tensor(0.25, device=device)
            hook.log_stats({"ppo_actor/update/grad_norm": 0.5, "timeperf/train_step": train_step_s})
            opt.step()
            schedule.step()
            if step % 2 == 0:
                params = list(model.parameters())
                expected["param_norm"][step] = _total_norm(params)
                update = _total_norm([p - b for p, b in zip(params, before)])
                expected["update_ratio"][step] = update / _total_norm(params)
            expected["reward"][step], expected["ppo_actor/update/grad_norm"][step] = 2.0 * step, 0.5
            expected["timeperf/train_step"][step] = 0.25
    assert waits == []  # the loop's own .item() calls wait; the hook's callbacks never do
    publisher.close()
    stats = publisher.stats()
    assert (stats.dropped, stats.failed, stats.invalid) == (0, 0, 0)

    got = read_series(bootstrap, run_id, stats.sent)
    for metric, by_step in expected.items():
        published = dict(got[(0, metric)])
        assert sorted(published) == sorted(by_step), metric
        for step, value in by_step.items():
            if math.isnan(value):
                assert math.isnan(published[step]), (metric, step)
            else:
                assert published[step] == pytest.approx(value, rel=1e-5), (metric, step)
    assert expected["grad_nonfinite"][4] == 4.0 and math.isnan(expected["grad_norm"][4])  # the NaN batch
    assert [s for s, _ in got[(0, "step_time_s")]] == [1, 2, 3, 4, 5]  # the first step has no predecessor
    times = dict(got[(0, "step_time_s")])
    assert all(v > 0 for v in times.values())
    assert dict(got[(0, "samples_per_s")]) == pytest.approx({s: 32 / t for s, t in times.items()}, rel=1e-9)
    assert [s for s, _ in got[(0, "data_wait_s")]] == list(range(6))
    assert all(0 <= v < 0.1 for _, v in got[(0, "data_wait_s")])  # a list yields at once
    # The run was shorter than one heartbeat: the memory readings came with close()'s final batch.
    assert stats.heartbeats == 0 and [s for s, _ in got[(0, "rss_bytes")]] == [5]  # the last step
    assert got[(0, "rss_bytes")][0][1] > 0
    gpu = {name for _, name in got if name.startswith("gpu_mem_")}
    if device == "cuda":
        assert gpu == {"gpu_mem_allocated_bytes", "gpu_mem_reserved_bytes", "gpu_mem_peak_bytes"}
        allocated, reserved, peak = (got[(0, f"gpu_mem_{n}_bytes")][-1][1] for n in ("allocated", "reserved", "peak"))
        assert 0 < allocated <= peak <= reserved, (allocated, reserved, peak)
    else:
        assert gpu == set()


class _Capture:
    """A publisher stand-in that keeps what the hook logs, read as the sender would read it."""

    def __init__(self):
        self.points, self.wakes = [], []  # wakes: how many points had been logged at each wake()

    def log(self, metrics, step):
        self.points.append((step, dict(metrics)))

    def defer(self, build, *args):
        step, metrics = build(*args)
        self.log(metrics, step)

    def add_sampler(self, sampler):
        pass

    def wake(self):
        self.wakes.append(len(self.points))

    def values(self, name: str) -> dict[int, float]:
        from rankwatch.producers.values import Chunk

        return {step: v for step, n, v in Chunk(self.points, [], []).resolve() if n == name}


@pytest.mark.parametrize("device", DEVICES)
def test_a_loop_that_clips_passes_its_pre_clip_norm(bootstrap, run_id, device):
    torch.manual_seed(2)
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher)
    expected = []
    for _ in range(3):
        model(torch.randn(8, 6, device=device)).pow(2).mean().mul(100).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        expected.append(total.item())
        hook.set_loss(0.0, grad_norm=total)
        opt.step()
        opt.zero_grad()
    publisher.close()
    got = read_series(bootstrap, run_id, publisher.stats().sent)
    assert [v for _, v in got[(0, "grad_norm")]] == pytest.approx(expected) and min(expected) > 0.1
    assert (0, "grad_nonfinite") not in got  # the hook made no pass of its own over the gradients


def test_data_wait_measures_a_slow_loader(bootstrap, run_id):
    def slow_loader():
        for _ in range(3):
            time.sleep(0.1)
            yield torch.randn(8, 6)

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher)
    for x in hook.wrap_loader(slow_loader()):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    publisher.close()
    waits = [v for _, v in read_series(bootstrap, run_id, publisher.stats().sent)[(0, "data_wait_s")]]
    assert len(waits) == 3 and all(0.09 < w < 1.0 for w in waits)


def test_compute_time_leaves_out_the_wait_for_a_cpu_but_not_what_fell_inside_the_data_wait(bootstrap, run_id):
    def spin(cpu_s: float) -> None:  # CPU time, however long the scheduler makes it take
        until = time.thread_time() + cpu_s
        while time.thread_time() < until:
            pass

    def loading():  # in this thread, as a DataLoader without workers loads
        for _ in range(4):
            spin(0.03)
            yield torch.randn(8, 6)

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher)
    with sharing_a_cpu(hogs=2):
        for x in hook.wrap_loader(loading()):
            spin(0.03)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    publisher.close()
    got = read_series(bootstrap, run_id, publisher.stats().sent)
    took, data, cpu_wait, compute = (dict(got[(0, m)]) for m in
                                     ("step_time_s", "data_wait_s", "cpu_wait_s", "compute_time_s"))
    for step in (1, 2, 3):
        # About a third of each wall second was this thread's: the loading and the step took 0.09 s each.
        assert cpu_wait[step] > 0.06 and data[step] > 0.05, (cpu_wait, data)
        # The step's own 0.03 s of CPU is left; with all of the wait taken out, nothing would be.
        assert 0.015 < compute[step] < took[step] - data[step] - 0.03, (compute, took, data, cpu_wait)


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_scaler_skipped_step_is_reported(bootstrap, run_id, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=16.0)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher, scaler=scaler, every=1)
    for step in range(4):
        x = torch.randn(8, 4, device=device)
        if step == 2:
            x[0, 0] = float("inf")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        hook.set_loss(loss)
        scaler.step(opt)
        scaler.update()
    hook.detach()
    assert "update" not in vars(scaler)  # the class's own update() is back
    publisher.close()
    got = read_series(bootstrap, run_id, publisher.stats().sent)
    assert got[(0, "step_skipped")] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 0.0)]
    assert [s for s, _ in got[(0, "grad_norm")]] == [0, 1, 3]  # the skipped step never reached the optimizer
    assert [s for s, _ in got[(0, "loss")]] == [0, 1, 2, 3]


def test_heartbeats_keep_coming_while_the_training_thread_sleeps(bootstrap, run_id):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, heartbeat_s=1.0)
    publisher.log({"loss": 0.5}, 7)
    time.sleep(4.0)  # a hung rank: no log() for 4 heartbeat periods
    beats = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id and HEARTBEAT in b["series"],
                         count=3, timeout_s=5)
    publisher.close()
    assert len(beats) >= 3
    points = [(b["series"][HEARTBEAT]["steps"][0], b["series"][HEARTBEAT]["values"][0])
              for b in sorted(beats, key=lambda b: b["seq"])]
    assert {step for step, _ in points} == {7}  # the last step the rank reached
    ages = [age for _, age in points]
    assert ages == sorted(ages) and ages[-1] - ages[0] > 1.5  # the age grows while nothing is logged
    assert all({"rss_bytes", "cpu_percent"} <= set(b["series"]) for b in beats)


# -- several ranks over gloo --------------------------------------------------------------------

WORLD = 2


SLOW_RANK, SLOW_STEP, SLOW_S = 1, 2, 2.5  # one rank dawdles before its backward on one step


def _rank_main(rank: int, port: int, bootstrap: str, run: str, results, device: str) -> None:
    """One rank of a 2-process DDP job over gloo, configured only by the environment, as torchrun does."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANKWATCH_RUN=run, RANKWATCH_BOOTSTRAP=bootstrap)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    # run, bootstrap, rank, world size, local rank from the environment; frequent heartbeats
    publisher = RankPublisher.from_env(samplers=[], heartbeat_s=0.3)
    model = torch.nn.parallel.DistributedDataParallel(_net().to(device))  # gloo takes CUDA tensors too
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hook = TrainerHook(model, opt, publisher)
    for step in range(4):
        loss = model(torch.randn(16, 6, device=device)).pow(2).mean()
        opt.zero_grad()
        if rank == SLOW_RANK and step == SLOW_STEP:
            time.sleep(SLOW_S)  # the straggler: its peer waits for it inside DDP's all-reduce
        loss.backward()  # DDP's bucket all-reduce, timed by the hook's comm hook
        hook.set_loss(loss)
        opt.step()
        torch.distributed.all_reduce(torch.ones(256, device=device))  # a plain collective, timed by the wrapper
    publisher.close()
    stats = publisher.stats()
    results.put((rank, publisher.local_rank, publisher.producer_id, stats.sent, stats.failed))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_every_rank_of_a_gloo_job_reports_with_its_identity_and_collective_time(bootstrap, run_id, device):
    import torch.multiprocessing as mp

    from rankwatch.broker import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()  # the rendezvous
    procs = [ctx.Process(target=_rank_main, args=(r, port, bootstrap, run_id, results, device)) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports = sorted(results.get(timeout=120) for _ in range(WORLD))
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * WORLD
    assert [(rank, local) for rank, local, *_ in reports] == [(r, r) for r in range(WORLD)]
    assert all(failed == 0 for *_, failed in reports)

    got = read_series(bootstrap, run_id, sum(sent for *_, sent, _ in reports))
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=1)
    assert batches[0]["world_size"] == WORLD
    for rank in range(WORLD):
        assert [s for s, _ in got[(rank, "loss")]] == [0, 1, 2, 3]
        collective = [v for _, v in got[(rank, "collective_time_s")]]
        assert len(collective) == 4 and all(v > 0 for v in collective), (rank, collective)

    # Both ranks' steps took as long as the straggler's; only the time outside collectives tells them apart.
    step_time = {r: dict(got[(r, "step_time_s")])[SLOW_STEP] for r in range(WORLD)}
    compute = {r: dict(got[(r, "compute_time_s")])[SLOW_STEP] for r in range(WORLD)}
    waited = {r: dict(got[(r, "collective_time_s")])[SLOW_STEP] for r in range(WORLD)}
    assert min(step_time.values()) > SLOW_S, step_time
    assert compute[SLOW_RANK] > SLOW_S > waited[SLOW_RANK], (compute, waited)
    assert waited[1 - SLOW_RANK] > SLOW_S - 0.5 > compute[1 - SLOW_RANK], (compute, waited)
    for r in range(WORLD):
        cpu_wait = dict(got[(r, "cpu_wait_s")])  # the time the rank's thread waited for a CPU (Linux)
        assert sorted(cpu_wait) == [1, 2, 3] and all(v >= 0 for v in cpu_wait.values()), cpu_wait
        for step, value in got[(r, "compute_time_s")]:
            # Less the CPU wait outside the collectives: none of it, at most all of it.
            left = max(0.0, dict(got[(r, "step_time_s")])[step] - dict(got[(r, "collective_time_s")])[step])
            assert left - cpu_wait[step] - 1e-9 <= value <= left + 1e-9, (step, value, left, cpu_wait[step])
    # While it dawdled, the peer's heartbeats showed it blocked in a collective; its own did not.
    blocked = {r: max(v for _, v in got[(r, "collective_wait_s")]) for r in range(WORLD)}
    assert blocked[1 - SLOW_RANK] > 1.0 > blocked[SLOW_RANK], blocked
