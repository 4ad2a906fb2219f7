"""What ``TrainerHook`` costs a training step: CPU steps (MLPs of ~1 to ~25 ms) with and without the
hook publishing to a real embedded broker, in the same process.

Two ways, because on a shared machine the speed of a core drifts by several percent from one second
to the next:

- paired single steps: two plain copies of the model and one hooked copy step in a fresh random
  order each round, so drift cancels within a round (block-bootstrap 95% intervals, the plain-vs-plain
  A/A as the noise floor);
- direct accounting, the hooked copy alone: CPU time inside the hook's callbacks, the training
  thread's waits for the GIL (from Linux's per-thread run and queue times), and the CPU time of
  the publisher's threads.

Linux only (it reads ``/proc/self/task/*/schedstat``). Nothing is asserted; it prints tables.

    python bench/step_cost.py [--step-seconds 20] [--linger-s S] [--models MODEL ...] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch

from step_clocks import Clocks, cpu_ns, cpu_times, mean_ci, paired_ratio, spent_ns

from rankwatch.producers import RankPublisher, TrainerHook, torch_hook
from rankwatch.broker import EmbeddedBroker, free_port

# (layer widths, batch) of the MLPs timed, on one torch thread. The hook's cost per
# step is some Python plus one pass over the gradients, so it weighs most where a step does little
# work per parameter: "tiny" (~1 ms) is the extreme, and "small, batch 512" shows the same weights
# doing 8x the work per step. A CPU training step of ~25 ms ("medium", "small, batch 512") is the
# realistic "small training step".
MODELS = {
    "tiny": ((32, 64, 10), 32),
    "small": ((256, 512, 512, 10), 64),
    "small, batch 512": ((256, 512, 512, 10), 512),
    "medium": ((256, 1024, 1024, 10), 64),
}
# glibc's malloc settings that keep freed memory in the process: no trimming, no mmap per tensor.
PINNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                    "MALLOC_TOP_PAD_": str(64 << 20)}
CLIPPING = ("small", "medium")  # also timed with a loop that clips and hands the hook its result
CONFIGS = {**{name: (name, False) for name in MODELS}, **{f"{m}, loop clips": (m, True) for m in CLIPPING}}


class _Arm:
    """One copy of a model and its AdamW; ``attach()`` gives it a ``TrainerHook``, ``detach()`` takes it off.

    Every copy of a model starts from the same weights and trains on the same batch, so two arms
    do the same work apart from the hook. With ``clip`` the loop clips its gradients and hands the
    result to the hook (``set_loss(loss, grad_norm=total)``), which then skips its own pass.
    """

    def __init__(self, model: str, clip: bool = False):
        widths, batch = MODELS[model]
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for n_in, n_out in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1])
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(batch, widths[0], generator=g), torch.randint(widths[-1], (batch,), generator=g)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.clip, self.batch = clip, batch
        self.publisher: RankPublisher | None = None
        self.hook: TrainerHook | None = None

    def attach(self, publisher: RankPublisher, step: int = 1, every: int | None = None) -> None:
        self.publisher = publisher
        self.hook = TrainerHook(self.model, self.opt, publisher, start_step=step, samples_per_step=self.batch,
                                every=every)

    def detach(self) -> int | None:
        """Take the hook off; returns its next step, for the next hook to go on from."""
        step = None if self.hook is None else self.hook.step
        if self.hook is not None:
            self.hook.detach()
        self.hook = self.publisher = None
        return step

    def step(self) -> None:
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0) if self.clip else None
        if self.hook is not None:
            if total is None:
                self.hook.set_loss(loss)
            else:
                self.hook.set_loss(loss, grad_norm=total)
        self.opt.step()


_CALLBACKS = ("set_loss", "before_step", "after_step", "end_step")
_ROLE_ROUNDS = 10  # rounds before the roles pass to the next assignment
_TURN = _ROLE_ROUNDS * 6  # rounds in one turn of the roles through all six assignments of three copies


def _timed(fn, spent: list[float]):
    """``fn``, adding the training thread's CPU seconds in each call to ``spent[0]``."""
    thread_clock = time.thread_time

    def timed(*args, **kwargs):
        started = thread_clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += thread_clock() - started

    return timed


def _time_callbacks(hook: TrainerHook) -> dict[str, list[float]]:
    """Time the training thread inside each of the hook's callbacks: ``{name: [CPU seconds]}``.

    The optimizer hooks look the callbacks up on the instance at every step, so wrapping them there
    times exactly what a training loop runs.
    """
    spent = {name: [0.0] for name in _CALLBACKS}
    for name in _CALLBACKS:
        setattr(hook, name, _timed(getattr(hook, name), spent[name]))
    return spent


def _stride(arm: _Arm, publisher: RankPublisher, seconds: float) -> int:
    """The stride the hook chooses by itself (``every=None``) on ``arm`` stepping alone."""
    arm.attach(publisher)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or arm.hook.step < 200:
        arm.step()
    every = arm.hook.every
    arm.detach()
    return every


def _rounds(arms: list[_Arm], publisher: RankPublisher, seconds: float, min_rounds: int,
            rng, every: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds of one step per arm, in a fresh random order each round, for about ``seconds``.

    The arms' roles (plain, plain again, hooked: a hook publishing to ``publisher``) change every 10
    rounds, through every assignment in turn and stopping after whole turns, so that no copy's
    own speed (where its tensors landed in memory) favours a role; the hook's step count goes on,
    so weight statistics keep their period; it measures every ``every`` steps (the stride it chose
    alone, fixed, as a hook attached afresh every 10 steps would start at 1; and with no 0.2 s rule,
    as the other copies' steps triple the hooked copy's time between its steps). Returns wall and
    training-thread CPU seconds per step, shape (role, rounds).
    """
    wall, cpu, step = [], [], 1
    assignments = list(itertools.permutations(range(len(arms))))
    assert _ROLE_ROUNDS * len(assignments) == _TURN
    clock, thread_clock = time.perf_counter, time.thread_time
    deadline = clock() + seconds
    while len(wall) < min_rounds or clock() < deadline or len(wall) % _TURN:
        if len(wall) % _ROLE_ROUNDS == 0:
            roles = assignments[len(wall) // _ROLE_ROUNDS % len(assignments)]
            for arm in arms:
                step = arm.detach() or step
            arms[roles[-1]].attach(publisher, step, every)
        w, c = [0.0] * len(arms), [0.0] * len(arms)
        for k in rng.permutation(len(arms)):
            c0, t0 = thread_clock(), clock()
            arms[k].step()
            w[k], c[k] = clock() - t0, thread_clock() - c0
        wall.append([w[k] for k in roles])
        cpu.append([c[k] for k in roles])
    for arm in arms:
        arm.detach()
    return np.array(wall).T, np.array(cpu).T


def _alone(arm: _Arm, seconds: float, others: dict[str, int | None], probe=lambda: None) -> dict:
    """Run one copy alone for about ``seconds``: per step, the training thread's blocked time (wall
    minus CPU minus run-queue time: waiting for the GIL); its page faults per step; and CPU
    nanoseconds of every thread of this process and of the ``others`` processes (name: pid) over
    the whole run. ``probe()`` runs after each step, untimed."""
    clocks, blocked = Clocks(), []
    others = {name: pid for name, pid in others.items() if pid}
    gc.collect()
    before, others_before = cpu_ns("self"), {name: cpu_ns(pid) for name, pid in others.items()}
    deadline = time.perf_counter() + seconds
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    while len(blocked) < 50 or time.perf_counter() < deadline:
        w0, c0, q0 = clocks.read()
        arm.step()
        w1, c1, q1 = clocks.read()
        blocked.append((w1 - w0) - (c1 - c0) - (q1 - q0))
        probe()
    faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / len(blocked)
    if arm.publisher is not None:
        arm.publisher.flush()  # the sender's work for these steps is done before its CPU time is read
    clocks.close()
    after = cpu_ns("self")
    spent = {}
    for name, pid in others.items():
        now = cpu_ns(pid)
        spent[name] = spent_ns(others_before[name], now, now)
    return {"steps": len(blocked), "blocked": np.array(blocked), "faults": faults, "threads": (before, after),
            "others": spent}


def section_step(bootstrap: str, seconds: float, broker_pid: int | None, linger_s: float | None,
                 configs: list[str]) -> None:
    options = {} if linger_s is None else {"linger_s": linger_s}
    linger = RankPublisher.__init__.__kwdefaults__["linger_s"] if linger_s is None else linger_s
    print(f"\n## A CPU training step with and without TrainerHook (~{seconds * 1.5:g} s per model)\n")
    print("Each model has three identical copies (same weights, same batch): two plain, and one with a")
    print(f"TrainerHook publishing to the embedded broker (publisher linger_s={linger:g}). 'loop clips': the")
    print("loop calls clip_grad_norm_ and passes its result, set_loss(loss, grad_norm=total), so the hook")
    print("skips its own pass over the gradients. Times are the training thread's CPU time (immune to")
    print("other jobs taking the core) unless a column says wall. Every step publishes its loss and")
    print("times; the hook measures the gradient statistics, lr and weight statistics every `every`")
    print("steps, the stride it chose by itself (every=None) on the hooked copy stepping alone, then held.\n")
    rng = np.random.default_rng(0)
    budget_rows, paired_rows, verdict_rows, callback_rows = [], [], [], []
    for label in configs:
        model, clip = CONFIGS[label]
        own = set(os.listdir("/proc/self/task"))
        pub = RankPublisher(run=f"bench-step-{len(budget_rows)}-{int(time.time())}", rank=0, world_size=1,
                            bootstrap=bootstrap, **options)
        arms = [_Arm(model, clip), _Arm(model, clip), _Arm(model, clip)]
        for arm in arms:  # warm-up: allocator, broker connection, first batches
            arm.attach(pub)
            for _ in range(10):
                arm.step()
            arm.detach()
        pub.flush()
        publisher_tids = set(os.listdir("/proc/self/task")) - own  # its sender thread
        every = _stride(arms[2], pub, max(2.0, seconds / 10))
        gc.collect()
        torch_hook.MAX_GAP_S, gap = float("inf"), torch_hook.MAX_GAP_S
        try:
            wall, cpu = _rounds(arms, pub, seconds, 120, rng, every)
        finally:
            torch_hook.MAX_GAP_S = gap

        # The hooked copy alone, as in training: its callbacks' time on the training thread, the
        # training thread's waits for the GIL, and the publisher's threads' CPU time. A timed no-op
        # after each step measures what the timer adds, with the caches as a step leaves them.
        arms[2].attach(pub, every=every)
        spent, timer = _time_callbacks(arms[2].hook), [0.0]
        hooked = _alone(arms[2], seconds / 4, {"broker": broker_pid, "shipper": pub.shipper_pid},
                        _timed(lambda: None, timer))
        arms[2].detach()
        pub.close()
        assert pub.stats().failed == 0 and pub.stats().dropped == 0, pub.stats()
        control = _alone(arms[0], seconds / 4, {})  # no publisher threads left: the GIL is the training thread's

        steps, plain = hooked["steps"], float(np.median(cpu[0]))
        each = {name: (cpu_s - timer[0]) / steps for name, (cpu_s,) in spent.items()}
        in_hook = sum(each.values())
        gil, gil_high = mean_ci(hooked["blocked"])
        control_gil = float(np.mean(control["blocked"]))
        sender = spent_ns(*hooked["threads"], publisher_tids) / steps / 1e9
        broker = f"{hooked['others']['broker'] / steps / 1e3:.0f}" if broker_pid else "not ours"
        shipper = hooked["others"]["shipper"] / steps / 1e9
        params = sum(p.numel() for p in arms[0].model.parameters())
        budget_rows.append(f"| {label} | {params:,} | {every} | {plain * 1e3:.3f} | {in_hook * 1e6:.1f} | {gil * 1e6:.1f} "
                           f"| {control_gil * 1e6:.1f} | {hooked['faults']:.0f} | {control['faults']:.0f} "
                           f"| {sender * 1e6:.1f} | {shipper * 1e6:.1f} | {broker} |")
        paired_rows.append(f"| {label} | {wall.shape[1]:,} | {np.median(wall[0]) * 1e3:.3f} | "
                           + " | ".join(paired_ratio(t[k], t[0], stat, _TURN)[0] for k in (2, 1)
                                        for t, stat in ((cpu, np.mean), (wall, np.median))) + " |")
        callback_rows.append(f"| {label} | " + " | ".join(f"{each[name] * 1e6:.1f}" for name in _CALLBACKS) + " |")
        _, synced, synced_high = paired_ratio(cpu[2], cpu[0], np.mean, _TURN)
        verdict_rows.append(f"| {label} | {plain * 1e3:.3f} | {in_hook / plain:.2%} | {synced:+.2%} | {gil / plain:.2%} "
                            f"| {synced_high + gil_high / plain:.2%} | {(sender + shipper) / plain:.2%} |")

    print("**Paired single steps.** Rounds of one step per copy, in a fresh random order each round, so")
    print("drift in machine speed hits all three alike; each round gives a paired difference. The roles")
    print("(plain, plain again, hooked) pass between the copies every 10 rounds, through every assignment,")
    print("so no copy's own speed favours a role. Hook vs plain, and plain vs plain (A/A: the noise")
    print("floor), as a share of the plain step: mean of the CPU-time differences, median of the")
    print("wall-time differences, [95% interval: a bootstrap over whole turns of the roles, 60 rounds each].\n")
    print("| model | rounds | plain step, wall (ms) | hook: CPU mean | hook: wall median | A/A: CPU mean "
          "| A/A: wall median |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(paired_rows))
    print("\nThe publisher's threads work in the background, during all three copies' steps alike, so the")
    print("paired differences hold the hook's cost on the training thread only. Below, the hooked copy")
    print("alone, per step: CPU time inside the hook's callbacks (timed from the bench, less the timer's")
    print("own cost measured after each step); the training thread's time blocked, i.e. neither running")
    print("nor queued for a core (it does no I/O, so: waiting for the GIL while the publisher's sender")
    print("thread holds it), with the plain copy alone and no publisher as the control; the training")
    print("thread's page faults (memory the allocator had given back to the system and takes again;")
    print("the hook keeps a step's gradients until the sender has read them, which changes when that")
    print("happens), with the same control; CPU time of the publisher's sender thread, of its shipper")
    print("process (the Kafka client) and of the broker, which on a cluster runs on another machine.\n")
    print("| model | params | every | plain step CPU (ms) | in hook callbacks, CPU (µs) | GIL wait (µs) "
          "| GIL wait, control (µs) | page faults | page faults, control | sender thread, CPU (µs) "
          "| shipper process, CPU (µs) | broker CPU (µs) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(budget_rows))
    print("\nThe callbacks one by one (µs of CPU per step; before_step holds the pass over the gradients,")
    print(f"before_step and after_step also the weight statistics every {TrainerHook.__init__.__kwdefaults__['weight_stats_every']} steps):\n")
    print("| model | " + " | ".join(_CALLBACKS) + " |")
    print("|---|" + "---|" * len(_CALLBACKS))
    print("\n".join(callback_rows))
    print("\n**Cost on the training step**, as a share of the plain step's CPU time: the paired CPU-time")
    print("difference (it includes what the callbacks cost indirectly: caches, allocator, garbage")
    print("collection) plus the GIL wait, and the upper ends of their 95% intervals added. Where a core")
    print("is free the sender thread and the shipper run beside training and cost it only the GIL wait;")
    print("on a machine with no core to spare they take their CPU time from it too (last column).\n")
    print("| model | plain step CPU (ms) | in hook callbacks | paired CPU difference | GIL wait "
          "| training-thread cost, upper bound | sender thread + shipper CPU |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(verdict_rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-seconds", type=float, default=20.0,
                    help="seconds of paired steps per model, plus half that for the hooked copy alone and a "
                         "plain control (default 20; more seconds, narrower intervals)")
    ap.add_argument("--linger-s", type=float,
                    help="the publisher's linger_s, how long points wait to share a message (default: RankPublisher's)")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="MODEL",
                    help=f"the configurations to time (default all: {', '.join(map(repr, CONFIGS))})")
    ap.add_argument("--bootstrap", help="a running broker; default: start the embedded one")
    ap.add_argument("--pinned-allocator", action="store_true",
                    help="run with glibc's settings pinned so that freed memory stays in the process "
                         "(no page faults from the allocator returning memory; see bench/step_cost_alone.py)")
    args = ap.parse_args(argv)
    if args.pinned_allocator and any(os.environ.get(k) != v for k, v in PINNED_ALLOCATOR.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED_ALLOCATOR})  # read at start-up
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    started = cpu_times()
    pinned = " (glibc's allocator settings pinned)" if args.pinned_allocator else ""
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads 1, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}{pinned}")
    if args.bootstrap:
        section_step(args.bootstrap, args.step_seconds, None, args.linger_s, args.models)
    else:
        with tempfile.TemporaryDirectory() as tmp, \
                EmbeddedBroker(port=free_port(), log_path=f"{tmp}/broker.log") as broker:
            section_step(broker.bootstrap, args.step_seconds, broker._proc.pid, args.linger_s, args.models)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    spent = [b - a for a, b in zip(started, cpu_times())]
    # A VM's vCPU can be descheduled by its host; the training thread then counts that time as
    # neither run nor queued, which the tables above read as GIL wait (the control's column shows it).
    print(f"CPU time stolen by the VM's host during the run: {spent[7] / max(1, sum(spent[:8])):.2%}")


if __name__ == "__main__":
    main()
