"""TrainerHook's gradient values when the loop or the optimizer changes the gradients in place: the
sender reads a CPU model's gradients after the step, so a value it would read changed must be
published right or not at all."""

from __future__ import annotations

import logging

import pytest
import torch
from test_telemetry import _Capture, _net, _total_norm, read_series

from rankwatch.producers import RankPublisher, TrainerHook


@pytest.mark.broker
@pytest.mark.parametrize("in_place", [False, True])
def test_grad_norm_is_right_whether_the_loop_replaces_or_zeroes_its_gradients(bootstrap, run_id, caplog, in_place):
    # On a CPU model the sender may read the step's gradient tensors after the step: zeroing them in
    # place instead of replacing them must cost no value, nor give a wrong one.
    caplog.set_level(logging.INFO, logger="rankwatch.producers.grad_stats")
    torch.manual_seed(2)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    hook = TrainerHook(model, opt, publisher, weight_stats_every=0, every=1)
    expected = {}
    for step in range(6):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        expected[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        opt.step()
        opt.zero_grad(set_to_none=not in_place)  # in place: before the sender has read them
    publisher.close()
    stats = publisher.stats()
    assert (stats.dropped, stats.failed, stats.invalid) == (0, 0, 0)
    published = dict(read_series(bootstrap, run_id, stats.sent)[(0, "grad_norm")])
    assert published == pytest.approx(expected, rel=1e-5)
    assert hook._grads.on_sender is not in_place
    assert ("keeps its gradient tensors" in caplog.text) is in_place


def test_a_step_whose_gradients_change_before_the_sender_reads_them_publishes_neither_gradient_value():
    model, publisher = _net(), _Capture()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    TrainerHook(model, opt, publisher, weight_stats_every=0, every=1)
    for _ in range(2):  # the first step is the probe, on the training thread; the second goes to the sender
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
    for p in model.parameters():
        p.grad.mul_(2.0)  # in place, before the sender has read the second step's gradients
    assert set(publisher.values("grad_norm")) == set(publisher.values("grad_nonfinite")) == {0}
    assert set(publisher.values("step_time_s")) == {1}


class _ShrinkingSGD(torch.optim.Optimizer):
    """Plain SGD that first scales the gradients in place, as some hand-written optimizers do."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.mul_(1e-3), alpha=-group["lr"])


def test_an_optimizer_that_changes_the_gradients_never_gets_a_wrong_grad_norm():
    # The hook gathers a CPU model's gradients for the sender after the update; this optimizer
    # changed them first, so what it leaves behind is not what the step computed.
    torch.manual_seed(3)
    model, publisher = _net(), _Capture()
    opt = _ShrinkingSGD(model.parameters(), lr=0.01)
    hook = TrainerHook(model, opt, publisher, weight_stats_every=0, every=1)
    expected = {}
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 6)).pow(2).mul(100).mean().backward()
        expected[step] = _total_norm([p.grad for p in model.parameters()])
        opt.step()
    published = publisher.values("grad_norm")
    assert published == pytest.approx(expected, rel=1e-5)  # every step, none of them the shrunk norm
    assert hook._grads.on_sender is False  # the first step showed it: the training thread reads them


def test_grad_norm_is_published_on_a_step_where_the_watched_parameter_has_no_gradient():
    torch.manual_seed(4)
    model, publisher = _net(), _Capture()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hook = TrainerHook(model, opt, publisher, weight_stats_every=0, every=1)
    first, last = model[0], model[2]
    expected = {}
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        features = torch.randn(8, 16) if step == 2 else first(torch.randn(8, 6))  # step 2 skips the first layer
        last(features.tanh()).pow(2).mean().backward()
        expected[step] = _total_norm([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
    assert hook._grads.probe_param is first.weight and hook._grads.on_sender
    assert publisher.values("grad_norm") == pytest.approx(expected, rel=1e-5)
