"""TrainerHook's stride: on fast loops the hook measures the gradients every few steps, and still
publishes every step's loss, times and whatever else the loop hands it."""

from __future__ import annotations

import time

import pytest
import torch
from test_telemetry import _net, _total_norm, read_series

from rankwatch.producers import RankPublisher, TrainerHook
from rankwatch.producers.stride import COST_BUDGET, MAX_EVERY, MAX_GAP_S, Stride


def _stride(every: int, cost_s: float, step_s: float) -> int:
    stride = Stride()
    stride.every = every
    return stride.update(cost_s, step_s)


def test_the_stride_is_the_power_of_two_that_keeps_measured_steps_within_budget():
    step_s = 1e-3
    at = COST_BUDGET * step_s  # the cost that one step may carry
    assert [_stride(1, k * at, step_s) for k in (0.5, 1, 1.1, 3, 8, 30)] == [1, 1, 2, 4, 8, 32]
    assert _stride(1, 1000 * at, step_s) == MAX_EVERY
    # Down only with a margin: from 32, a need of 20 stays; 10 goes to 16.
    assert (_stride(32, 20 * at, step_s), _stride(32, 10 * at, step_s)) == (32, 16)
    # Steps so long that the stride passes the longest wait come down at once, margin or not.
    slow = MAX_GAP_S / 4
    assert (_stride(1, 100 * COST_BUDGET * slow, slow), _stride(8, 100 * COST_BUDGET * slow, slow)) == (2, 2)


@pytest.mark.broker
def test_between_measured_steps_every_step_still_publishes_its_loss_times_and_metrics(bootstrap, run_id):
    torch.manual_seed(3)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher, samples_per_step=8, weight_stats_every=5, every=4)
    losses, grad_norms = {}, {}
    for step, x in enumerate(hook.wrap_loader([torch.randn(8, 6) for _ in range(10)])):
        for half in x.chunk(2):  # two micro-batches: a step's loss is their mean
            loss = model(half).pow(2).mean()
            loss.backward()
            hook.set_loss(loss, reward=float(step))
            losses.setdefault(step, []).append(loss.item())
        grad_norms[step] = _total_norm([p.grad for p in model.parameters()])
        hook.log_stats({"ppo_actor/kl": 0.5 * step})
        opt.step()
        opt.zero_grad()
    publisher.close()
    got = read_series(bootstrap, run_id, publisher.stats().sent)

    every_step, measured = list(range(10)), [0, 4, 8]
    assert dict(got[(0, "loss")]) == pytest.approx({s: sum(v) / 2 for s, v in losses.items()}, rel=1e-6)
    assert dict(got[(0, "reward")]) == {s: float(s) for s in every_step}
    assert dict(got[(0, "ppo_actor/kl")]) == {s: 0.5 * s for s in every_step}
    times = dict(got[(0, "step_time_s")])
    assert sorted(times) == every_step[1:] and all(t > 0 for t in times.values())
    assert dict(got[(0, "samples_per_s")]) == pytest.approx({s: 8 / t for s, t in times.items()}, rel=1e-9)
    assert [s for s, _ in got[(0, "data_wait_s")]] == every_step
    # Measured every 4th step only: the gradient statistics, lr and the weight statistics.
    assert dict(got[(0, "grad_norm")]) == pytest.approx({s: grad_norms[s] for s in measured}, rel=1e-5)
    assert [s for s, _ in got[(0, "grad_nonfinite")]] == [s for s, _ in got[(0, "lr")]] == measured
    assert [s for s, _ in got[(0, "param_norm")]] == [0, 8]  # the first measured step at or after 0 and 5


def _train(hook: TrainerHook, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, pause_s: float) -> list:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        hook.set_loss(loss)
        opt.step()
        losses.append((hook.step - 1, loss.item()))
        time.sleep(pause_s)
    return losses


@pytest.mark.broker
def test_the_stride_grows_on_a_fast_loop_and_comes_back_to_one_on_a_slow_one(bootstrap, run_id):
    torch.manual_seed(4)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher)
    # A step of a few hundred µs: the measured step's callbacks alone would cost several percent.
    losses = _train(hook, model, opt, 300, 0.0)
    fast = hook.every
    # A step of 80 ms: two of them already pass half the longest wait between measured steps.
    losses += _train(hook, model, opt, 16, 0.08)
    slow = hook.every
    publisher.close()
    got = read_series(bootstrap, run_id, publisher.stats().sent)

    assert fast > 1 and slow == 1, (fast, slow)
    assert dict(got[(0, "loss")]) == pytest.approx(dict(losses), rel=1e-6)  # every step, whatever the stride
    measured = [s for s, _ in got[(0, "grad_norm")]]
    assert len(measured) < 300 // 2 + 16
    assert measured[-6:] == list(range(310, 316))  # back to every step
    assert [s for s, _ in got[(0, "step_time_s")]] == list(range(1, 316))  # the times of every step
