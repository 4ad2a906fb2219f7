"""A CPU model's gradients handed to the sender thread: the bound on what waits, the fused read, and
large gradients read at once."""

from __future__ import annotations

import logging

import pytest
import torch
from test_telemetry import _Capture, _net, _total_norm

from rankwatch.producers import TrainerHook, grad_norms
from rankwatch.producers.values import Unavailable


def test_a_sender_that_falls_behind_keeps_a_bounded_number_of_steps_gradients_alive(monkeypatch, caplog):
    torch.manual_seed(5)
    model, publisher = _net(), _Capture()  # a sender that reads nothing until values() is called
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monkeypatch.setattr(grad_norms, "KEEP_GRAD_BYTES", 3 * sum(p.numel() * 4 for p in model.parameters()))
    hook = TrainerHook(model, opt, publisher, weight_stats_every=0, every=1)
    expected = {}

    def step(n: int) -> None:
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 6)).pow(2).mean().backward()
        expected[n] = _total_norm([p.grad for p in model.parameters()])
        opt.step()

    with caplog.at_level(logging.WARNING, logger="rankwatch.producers.grad_norms"):
        for n in range(8):
            step(n)
    # Step 0 showed nothing changes the gradients; steps 1-3 handed theirs to the sender; from step 4
    # on the training thread computed the norms, as the bound allows three steps' worth.
    assert [r() is not None and r().holding() for r in hook._grads.handoff.unread] == [True] * 3
    assert "has yet to read 3 steps of gradients" in caplog.text and "(4 steps so far)" in caplog.text
    assert publisher.values("grad_norm") == pytest.approx(expected, rel=1e-5)  # the sender reads them now
    step(8)  # and the next step's gradients go to the sender again
    assert len(hook._grads.handoff.unread) == 1 and publisher.values("grad_norm") == pytest.approx(expected, rel=1e-5)


def test_the_sender_reads_every_waiting_step_at_once_and_each_keeps_its_own_norms():
    torch.manual_seed(6)
    handoff, changed = grad_norms.Handoff(grad_bytes=1), []
    steps = [[torch.randn(3, 4), torch.randn(5).to(torch.float64), torch.randn(2, 2)] for _ in range(40)]
    handed = [handoff.hand(grads, grads[0], grads[0]._version, changed.append) for grads in steps]
    steps[7][0].mul_(2.0)  # in place, before the sender read it: that step loses its values, and only it
    assert handed[0].total.item() == pytest.approx(_total_norm(steps[0]))  # 120 tensors: two slices
    assert not any(lazy.holding() for lazy in handed)  # the first value asked for read all of them
    for n, lazy in enumerate(handed):
        if n == 7:
            with pytest.raises(Unavailable):
                lazy.total.item()
        else:
            assert lazy.total.item() == pytest.approx(_total_norm(steps[n]), rel=1e-6)
            assert lazy.nonfinite.item() == 0
    assert changed == ["the gradients changed before the sender read them"]


def test_large_gradients_are_read_as_soon_as_they_are_handed_over():
    torch.manual_seed(7)
    small, big = _net(), torch.nn.Sequential(torch.nn.Linear(6, 512), torch.nn.Linear(512, 512))
    assert sum(p.numel() * 4 for p in big.parameters()) >= grad_norms.PROMPT_READ_BYTES > 4 * sum(
        p.numel() for p in small.parameters())
    wakes = {}
    for name, model in (("small", small), ("big", big)):
        publisher, opt = _Capture(), torch.optim.SGD(model.parameters(), lr=0.01)
        TrainerHook(model, opt, publisher, weight_stats_every=0, every=2)
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
        wakes[name] = publisher.wakes
    # Step 0 computes the norms on the training thread; the measured steps 2 and 4 hand them over,
    # and the sender is woken once each step's point is logged.
    assert wakes == {"small": [], "big": [3, 5]}
