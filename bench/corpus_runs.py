"""Clean training runs full of *normal* structure, recorded as rankwatch would receive them.

A real torch loop on CPU, instrumented by the real ``TrainerHook`` and ``RankPublisher`` (the last
hop writes wire messages to a file: ``scenario_runs.CapturePublisher``), with the patterns that
make a naive detector fire on a healthy run switched on:

- linear learning-rate warm-up, then a step decay (x0.3) every ``decay_every`` steps;
- an evaluation pause every ``eval_every`` steps (eval_loss / eval_accuracy logged, the step slow);
- a checkpoint save (``torch.save``) every ``ckpt_every`` steps;
- epoch boundaries (the loader reshuffles; the first batch of an epoch is slow);
- gradient accumulation (``accum`` micro-batches per optimizer step);
- a host-memory sawtooth (``mem_mb`` grows each step and drops at each checkpoint);
- a data loader that hiccups every ``hiccup_every`` steps.

Nothing here is a fault: every alert on these runs is a false alert. Seeds below
``HOLDOUT_SEED`` are the tuning part, the others the held-out part (other periods as well).

    python bench/corpus_runs.py --out bench/data/corpus_runs    # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenario_runs import CapturePublisher  # noqa: E402

from rankwatch.broker import free_port  # noqa: E402
from rankwatch.producers import TrainerHook  # noqa: E402

HOLDOUT_SEED = 100


@dataclass(frozen=True)
class CleanRun:
    seed: int
    ranks: int
    steps: int
    eval_every: int
    ckpt_every: int
    epoch_steps: int
    decay_every: int
    accum: int
    hiccup_every: int
    warmup: int = 30

    @property
    def name(self) -> str:
        return f"clean{self.ranks}r_s{self.seed}"


#: Tuning runs (seeds < 100) and held-out runs, which also use other periods.
RUNS = (
    CleanRun(0, 2, 700, eval_every=50, ckpt_every=100, epoch_steps=120, decay_every=250, accum=2, hiccup_every=37),
    CleanRun(1, 1, 700, eval_every=25, ckpt_every=200, epoch_steps=90, decay_every=300, accum=1, hiccup_every=23),
    CleanRun(2, 2, 700, eval_every=40, ckpt_every=150, epoch_steps=200, decay_every=200, accum=4, hiccup_every=50),
    CleanRun(100, 2, 700, eval_every=30, ckpt_every=120, epoch_steps=150, decay_every=220, accum=2, hiccup_every=29),
    CleanRun(101, 1, 700, eval_every=60, ckpt_every=175, epoch_steps=100, decay_every=350, accum=3, hiccup_every=41),
    CleanRun(102, 2, 700, eval_every=45, ckpt_every=90, epoch_steps=250, decay_every=260, accum=1, hiccup_every=19),
)


def _lr(run: CleanRun, step: int, peak: float = 3e-3) -> float:
    if step < run.warmup:
        return peak * (step + 1) / run.warmup
    return peak * 0.3 ** (step // run.decay_every)


def _train(run: CleanRun, rank: int, out: Path, port: int) -> None:
    torch.set_num_threads(1)
    if run.ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=run.ranks, timeout=timedelta(seconds=60))
    pub = CapturePublisher(path=out / f"rank{rank}.bin", run=run.name, rank=rank, world_size=run.ranks,
                           heartbeat_s=0.25)
    torch.manual_seed(run.seed)
    g = torch.Generator().manual_seed(1000 + run.seed)
    w1, w2 = torch.randn(32, 32, generator=g), torch.randn(32, 10, generator=g)
    gen = torch.Generator().manual_seed(run.seed * 100 + rank)
    x_all = torch.randn(4096, 32, generator=gen)
    y_all = (torch.tanh(x_all @ w1) @ w2).argmax(1)
    y_all = torch.where(torch.rand(4096, generator=gen) < 0.1, torch.randint(0, 10, (4096,), generator=gen), y_all)
    x_eval, y_eval = x_all[:512], y_all[:512]
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    if run.ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=_lr(run, 0))
    hook = TrainerHook(model, opt, pub, samples_per_step=32 * run.accum, every=1)
    mem = [200.0]  # a host-memory sawtooth: caches grow until a checkpoint frees them

    def loader():
        step = 0
        while True:
            order = torch.randperm(4096, generator=gen)
            time.sleep(0.03)  # a new epoch: workers restart, the first batch is slow
            for i in range(run.epoch_steps):
                if step % run.hiccup_every == run.hiccup_every - 1:
                    time.sleep(0.012)  # the loader hiccups on a period (a shard boundary, a GC)
                idx = order[(i * 32 * run.accum) % 4064:][: 32 * run.accum]
                step += 1
                yield x_all[idx], y_all[idx]

    for step, (x, y) in zip(range(run.steps), hook.wrap_loader(loader())):
        time.sleep(0.008)  # the simulated accelerator, as in scenario_runs
        for group in opt.param_groups:
            group["lr"] = _lr(run, step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(run.accum), y.chunk(run.accum)):
            loss = torch.nn.functional.cross_entropy(model(xm), ym) / run.accum
            loss.backward()
            total += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mem[0] += 0.5 + 0.1 * (rank + 1)
        extra = {"mem_mb": mem[0]}
        if step > 0 and step % run.eval_every == 0:
            with torch.no_grad():
                logits = model(x_eval)
                extra["eval_loss"] = float(torch.nn.functional.cross_entropy(logits, y_eval))
                extra["eval_accuracy"] = float((logits.argmax(1) == y_eval).float().mean())
            time.sleep(0.05)  # evaluation is slower than a step
        if step > 0 and step % run.ckpt_every == 0:
            torch.save(model.state_dict(), io.BytesIO())
            time.sleep(0.08)  # writing to a slow disk
            mem[0] = 200.0
        hook.set_loss(torch.tensor(total), grad_norm=grad_norm, **extra)
        opt.step()
    pub.close()
    if run.ranks > 1:
        dist.destroy_process_group()


def record(run: CleanRun, root: Path) -> Path:
    out = root / run.name
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.bin"):
        stale.unlink()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_train, args=(run, r, out, port), daemon=True) for r in range(run.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    (out / "done").write_text("ok")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data" / "corpus_runs")
    args = parser.parse_args(argv)
    for run in RUNS:
        started = time.perf_counter()
        record(run, args.out)
        print(f"{run.name}: {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
