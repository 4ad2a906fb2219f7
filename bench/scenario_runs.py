"""Recording real small training runs with injected faults, as rankwatch would see them.

Each rank is a real process (fork) running a real torch loop with the real ``TrainerHook`` and a
``RankPublisher`` whose only change is the last hop: instead of handing each event to Kafka it
appends the event's wire bytes to a file. Batching (``linger_s``), heartbeats, the samplers and the
conversion of tensors to floats are the production code; the files hold exactly what the broker
would have carried, in the order and at the times it would have been sent.

Two tasks: an MLP learning a noisy teacher (supervised; ``ddp`` all-reduces its gradients over gloo,
or every rank trains alone), and REINFORCE on a contextual bandit (data-parallel). Faults change
one thing in the loop of one rank or of every rank; ``Fault`` says which, from which step, for how
long.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import struct
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 (torch.optim imports it lazily: 3 s in every forked rank, once here)
import torch.distributed as dist
import torch.distributions  # noqa: F401

from rankwatch.producers import RankPublisher, TrainerHook
from rankwatch.broker import free_port
from rankwatch.contract import TelemetryBatch

BATCH = 64
EVAL_EVERY = 5  # steps between evaluations (eval_accuracy), as a trainer's eval callback would


class CapturePublisher(RankPublisher):
    """The real publisher, with the broker swapped for an append-only file of wire messages."""

    def __init__(self, *, path: Path, **kwargs):
        self._out = open(path, "ab")  # noqa: SIM115 (closed by os exit; every write is flushed)
        super().__init__(**kwargs)

    def _send(self, event) -> None:
        data = event.to_bytes()
        self._out.write(struct.pack("<I", len(data)) + data)
        self._out.flush()  # a rank killed mid-run keeps what it already "sent"


def read_batches(path: Path) -> list[TelemetryBatch]:
    data, out, at = path.read_bytes(), [], 0
    while at + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, at)
        if at + 4 + n > len(data):
            break  # a write cut short by a kill
        out.append(TelemetryBatch.from_bytes(data[at + 4 : at + 4 + n]))
        at += 4 + n
    return out


@dataclass(frozen=True)
class Fault:
    kind: str  # nan, spike, lr100, straggler, hang, exit, label_perm, env_shift
    onset: int
    duration: int = 1  # steps (straggler, lr100); hang/exit/label_perm/env_shift last to the end
    rank: int = 0  # the faulty rank, for faults of one rank


@dataclass(frozen=True)
class RunSpec:
    run: str
    task: str  # "sup" or "rl"
    ddp: bool
    seed: int
    ranks: int
    steps: int
    fault: Fault | None
    out: str
    heartbeat_s: float = 0.25
    hang_s: float = 4.0  # a hung rank's silence; also how long peers of a dead rank hang before torchrun kills them
    straggle_s: float = 0.010
    device_s: float = 0.015  # simulated accelerator time per step (see _step_host_side)

    def active(self, kind: str, step: int, rank: int | None = None) -> bool:
        f = self.fault
        if f is None or f.kind != kind or (rank is not None and rank != f.rank):
            return False
        return f.onset <= step < f.onset + f.duration


def _schedule(step: int, steps: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class _Log:
    """Wall times of the fault, written by each rank on its way out (or before it dies)."""

    def __init__(self, spec: RunSpec, rank: int):
        self.path = Path(spec.out) / f"meta{rank}.json"
        self.info: dict = {"rank": rank}

    def mark(self, name: str, step: int) -> None:
        self.info.setdefault(name, {"step": step, "ts": time.time()})

    def save(self, **more) -> None:
        self.path.write_text(json.dumps({**self.info, **more}))


def _teacher(seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    w1, w2 = torch.randn(32, 32, generator=g), torch.randn(32, 10, generator=g)
    return lambda x: torch.tanh(x @ w1) @ w2


def _supervised(spec: RunSpec, rank: int, pub: RankPublisher, log: _Log) -> None:
    torch.manual_seed(spec.seed)  # same initial weights on every rank, as DDP broadcasts them
    teacher = _teacher(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed * 100 + rank)
    x_eval = torch.randn(512, 32, generator=gen)
    y_eval = teacher(x_eval).argmax(1)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    if spec.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    hook = TrainerHook(model, opt, pub, samples_per_step=BATCH)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(spec.seed))

    def batches():
        while True:
            x = torch.randn(BATCH, 32, generator=gen)
            y = teacher(x).argmax(1)
            noisy = torch.rand(BATCH, generator=gen) < 0.1  # irreducible loss keeps the curve noisy
            yield x, torch.where(noisy, torch.randint(0, 10, (BATCH,), generator=gen), y)

    for step, (x, y) in zip(range(spec.steps), hook.wrap_loader(batches())):
        _step_host_side(spec, rank, step, log)
        lr = _schedule(step, spec.steps, 3e-3) * (100 if spec.active("lr100", step) else 1)
        if spec.active("lr100", step):
            log.mark("inject", step)
        for group in opt.param_groups:
            group["lr"] = lr
        if spec.active("nan", step, rank):
            log.mark("inject", step)
            x[0, 0] = float("nan")
        if spec.active("spike", step, rank):
            log.mark("inject", step)
            x, y = x * 20.0, torch.randint(0, 10, (BATCH,), generator=gen)  # a corrupted batch
        if spec.fault is not None and spec.fault.kind == "label_perm" and step >= spec.fault.onset:
            log.mark("inject", step)
            y = perm[y]  # a data pipeline bug: every label mapped to the wrong class
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        extra = {}
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                extra["eval_accuracy"] = (model(x_eval).argmax(1) == y_eval).float().mean().item()
        hook.set_loss(loss.detach(), grad_norm=grad_norm, **extra)
        if torch.isfinite(grad_norm):
            opt.step()  # the hook publishes the step here
        else:
            hook.end_step(skipped=1)  # a non-finite step is skipped, as a gradient scaler does


def _bandit(spec: RunSpec, rank: int, pub: RankPublisher, log: _Log) -> None:
    """REINFORCE with a running baseline and an entropy bonus on an 8-context, 5-arm Bernoulli bandit."""
    torch.manual_seed(spec.seed)
    arms, dims = 5, 8
    world = torch.Generator().manual_seed(1000 + spec.seed)
    true_w = torch.randn(dims, arms, generator=world) * 1.5
    gen = torch.Generator().manual_seed(spec.seed * 100 + rank)
    policy: torch.nn.Module = torch.nn.Linear(dims, arms)
    if spec.ddp:
        policy = torch.nn.parallel.DistributedDataParallel(policy)
    opt = torch.optim.Adam(policy.parameters(), lr=0.02)
    hook = TrainerHook(policy, opt, pub, samples_per_step=BATCH)
    baseline = 0.0
    for step in range(spec.steps):
        _step_host_side(spec, rank, step, log)
        ctx = torch.randn(BATCH, dims, generator=gen)
        payoff = torch.sigmoid(ctx @ true_w)
        if spec.fault is not None and spec.fault.kind == "env_shift" and step >= spec.fault.onset:
            log.mark("inject", step)
            payoff = 1.0 - payoff  # a sign bug in the reward: what paid now does not
        logits = policy(ctx)
        actions = torch.distributions.Categorical(logits=logits)
        action = actions.sample()
        reward = torch.bernoulli(payoff.gather(1, action[:, None]).squeeze(1), generator=gen)
        entropy = actions.entropy().mean()
        loss = -(actions.log_prob(action) * (reward - baseline)).mean() - 0.01 * entropy
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 5.0)
        hook.set_loss(loss.detach(), grad_norm=grad_norm, reward=reward.mean().item(), entropy=entropy.item())
        opt.step()
        baseline = 0.95 * baseline + 0.05 * reward.mean().item()


def _step_host_side(spec: RunSpec, rank: int, step: int, log: _Log) -> None:
    """The step's wait on a simulated accelerator, and the faults of the process rather than the model.

    A GPU trainer's host thread spends most of a step waiting on the device; a sleep stands for it.
    Besides being realistic, it keeps several ranks on two cores from fighting for the CPU, whose
    scheduling noise would otherwise swamp step times (a real cluster gives each rank its own device).
    A straggler (a throttled device, a slow host) takes ``straggle_s`` longer each step.
    """
    wait = spec.device_s
    if spec.active("straggler", step, rank):
        log.mark("inject", step)
        wait += spec.straggle_s
    time.sleep(wait)
    f = spec.fault
    if f is None or step != f.onset or rank != f.rank:
        return
    if f.kind == "hang":
        log.mark("inject", step)
        time.sleep(spec.hang_s)  # the training thread is stuck; the publisher's heartbeats go on
    elif f.kind == "exit":
        log.mark("inject", step)
        log.save(died=True)
        os._exit(1)  # no close(): what was still queued is lost, as in a crash


def _worker(spec: RunSpec, rank: int, port: int) -> None:
    torch.set_num_threads(1)
    log = _Log(spec, rank)
    if spec.ddp:
        timeout = timedelta(seconds=spec.hang_s + 30)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=spec.ranks, timeout=timeout)
    pub = CapturePublisher(path=Path(spec.out) / f"rank{rank}.bin", run=spec.run, rank=rank,
                           world_size=spec.ranks, heartbeat_s=spec.heartbeat_s)
    try:
        (_supervised if spec.task == "sup" else _bandit)(spec, rank, pub, log)
    except RuntimeError as exc:  # a peer died: gloo raises, NCCL would hang in the collective
        log.save(error=str(exc)[:200], died=True)
        # Hung (heartbeats go on) until the launcher kills the job, hang_s after the death.
        try:
            died_at = json.loads((Path(spec.out) / f"meta{spec.fault.rank}.json").read_text())["inject"]["ts"]
        except (OSError, KeyError, ValueError, AttributeError):
            died_at = time.time()
        time.sleep(max(0.0, died_at + spec.hang_s - time.time()))
        os._exit(1)
    log.save()
    pub.close()
    if spec.ddp:
        dist.destroy_process_group()


def record(spec: RunSpec) -> None:
    """Run ``spec`` (one process per rank) and leave its messages and fault times in ``spec.out``."""
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    (Path(spec.out) / "spec.json").write_text(json.dumps(asdict(spec)))
    ctx = multiprocessing.get_context("fork")  # the parent ran no torch op, so forking is safe
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(spec, r, port), daemon=True) for r in range(spec.ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120 + spec.steps * 0.05
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def load_spec(path: Path) -> RunSpec:
    raw = json.loads((path / "spec.json").read_text())
    raw["fault"] = Fault(**raw["fault"]) if raw["fault"] else None
    return RunSpec(**raw)


def load_meta(path: Path, ranks: int) -> list[dict]:
    out = []
    for r in range(ranks):
        f = path / f"meta{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "missing": True})
    return out
