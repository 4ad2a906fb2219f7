"""Evaluator trigger semantics, checkpoint round trips, control advice, and rank agreement over gloo."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest

from rankwatch.producers import Evaluator
from rankwatch.broker import free_port


class Clock:
    """Monotonic seconds the test sets by hand: freq_secs without sleeping."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Advice:
    """Stands in for a ControlListener's latest set_eval_interval value."""

    def __init__(self, value: float | None = None):
        self.value = value

    def eval_interval(self) -> float | None:
        return self.value


def fired_steps(evaluator: Evaluator, steps, *, clock: Clock | None = None, secs_per_step=0.0, epoch_len=None):
    fired = []
    for step in steps:
        if clock is not None:
            clock.t = step * secs_per_step
        epoch = None if epoch_len is None else step // epoch_len
        if evaluator.should_evaluate(step=step, epoch=epoch):
            fired.append(step)
    return fired


def test_all_none_never_fires():
    clock = Clock()
    evaluator = Evaluator(clock=clock)
    assert fired_steps(evaluator, range(1000), clock=clock, secs_per_step=3600, epoch_len=10) == []


def test_steps_fire_every_n_updates_and_once_per_step():
    evaluator = Evaluator(freq_steps=10)
    assert fired_steps(evaluator, range(35)) == [10, 20, 30]
    assert evaluator.should_evaluate(step=40) is True
    assert evaluator.should_evaluate(step=40) is False  # asking twice at one step fires once


def test_steps_count_from_the_first_check_and_from_each_firing():
    evaluator = Evaluator(freq_steps=10)
    assert fired_steps(evaluator, [100, 105, 110, 113, 121, 125, 131]) == [110, 121, 131]


def test_secs_fire_on_wall_time_without_torch_distributed():
    clock = Clock()
    evaluator = Evaluator(freq_secs=25, clock=clock)
    assert fired_steps(evaluator, range(40), clock=clock, secs_per_step=3) == [9, 18, 27, 36]
    assert evaluator.last_triggers == ("secs",)


def test_epochs_fire_when_epochs_complete():
    evaluator = Evaluator(freq_epochs=2)
    assert fired_steps(evaluator, range(60), epoch_len=10) == [20, 40]
    assert evaluator.last_triggers == ("epochs",)


def test_triggers_or_combine_and_each_counts_from_its_own_last_firing():
    clock = Clock()
    evaluator = Evaluator(freq_steps=10, freq_secs=25, clock=clock)
    # secs alone fire at 9, 18, 27; steps alone at 10, 20, 30: a secs firing does not restart the step count
    assert fired_steps(evaluator, range(31), clock=clock, secs_per_step=3) == [9, 10, 18, 20, 27, 30]


def test_simultaneous_triggers_fire_once_and_name_every_reason():
    clock = Clock()
    evaluator = Evaluator(freq_steps=5, freq_epochs=1, clock=clock)
    assert fired_steps(evaluator, range(11), epoch_len=5) == [5, 10]
    assert evaluator.last_triggers == ("steps", "epochs")
    assert evaluator.evaluations == 2


def test_eval_before_train_fires_at_the_first_check_only():
    evaluator = Evaluator(freq_steps=5, eval_before_train=True)
    assert fired_steps(evaluator, range(12)) == [0, 5, 10]
    only_before = Evaluator(eval_before_train=True)
    assert fired_steps(only_before, range(100)) == [0]
    assert only_before.last_triggers == ("before_train",)


def test_state_round_trip_continues_the_same_schedule():
    def evaluator(clock):
        return Evaluator(freq_steps=7, freq_secs=50, freq_epochs=3, eval_before_train=True, clock=clock)

    clock = Clock()
    uninterrupted = fired_steps(evaluator(clock), range(200), clock=clock, secs_per_step=4, epoch_len=20)

    clock = Clock()
    first = evaluator(clock)
    before = fired_steps(first, range(123), clock=clock, secs_per_step=4, epoch_len=20)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint is JSON-able
    # A new process: its monotonic clock has another origin, and the restart took 900 s.
    restarted_clock = Clock(1e6)
    second = evaluator(restarted_clock)
    second.load_state_dict(state)
    after = []
    for step in range(123, 200):
        restarted_clock.t = 1e6 + step * 4 - 122 * 4  # time since the checkpoint, downtime excluded
        if second.should_evaluate(step=step, epoch=step // 20):
            after.append(step)
    assert before + after == uninterrupted
    assert 0 in uninterrupted and after  # the schedule had firings on both sides of the restart
    assert second.evaluations == len(uninterrupted)


def test_restored_run_does_not_evaluate_before_train_again():
    first = Evaluator(freq_steps=100, eval_before_train=True)
    assert first.should_evaluate(step=0)
    fired_steps(first, range(1, 50))
    second = Evaluator(freq_steps=100, eval_before_train=True)
    second.load_state_dict(first.state_dict())
    assert fired_steps(second, range(50, 160)) == [100]


def test_unknown_state_version_is_refused():
    with pytest.raises(ValueError, match="version"):
        Evaluator().load_state_dict({"version": 99})


@pytest.mark.parametrize(
    "kwargs",
    [{"freq_steps": 0}, {"freq_secs": -1.0}, {"freq_epochs": 0}, {"control": Advice()},
     {"control": Advice(), "interval_bounds": (5, 2)}, {"control": Advice(), "interval_bounds": (0, 2)}],
)
def test_bad_configuration_is_refused(kwargs):
    with pytest.raises(ValueError):
        Evaluator(**kwargs)


def test_interval_advice_is_followed_within_bounds():
    advice = Advice()
    evaluator = Evaluator(freq_steps=10, control=advice, interval_bounds=(4, 20))
    assert fired_steps(evaluator, range(0, 21)) == [10, 20]  # no advice yet: freq_steps holds
    advice.value = 5
    assert fired_steps(evaluator, range(21, 36)) == [25, 30, 35]
    advice.value = 1000  # clamped to the upper bound
    assert fired_steps(evaluator, range(36, 80)) == [55, 75]
    assert evaluator.interval_steps == 20
    advice.value = 0.5  # clamped to the lower bound
    assert fired_steps(evaluator, range(80, 88)) == [80, 84]
    advice.value = math.nan  # unusable advice keeps the interval in force
    assert fired_steps(evaluator, range(88, 96)) == [88, 92]


def test_interval_advice_turns_the_step_trigger_on():
    advice = Advice()
    evaluator = Evaluator(control=advice, interval_bounds=(2, 50))
    assert fired_steps(evaluator, range(30)) == []
    advice.value = 10
    assert fired_steps(evaluator, range(30, 60)) == [30, 40, 50]


def test_advised_interval_survives_a_restart_within_the_new_bounds():
    evaluator = Evaluator(freq_steps=10, control=Advice(6), interval_bounds=(2, 50))
    fired_steps(evaluator, range(13))
    restored = Evaluator(freq_steps=10, control=Advice(None), interval_bounds=(2, 5))
    restored.load_state_dict(evaluator.state_dict())
    assert restored.interval_steps == 5
    assert fired_steps(restored, range(13, 25)) == [17, 22]
    plain = Evaluator(freq_steps=10)  # not following advice: its own freq_steps stands
    plain.load_state_dict(evaluator.state_dict())
    assert plain.interval_steps == 10


def test_final_weights_are_evaluated_where_periodic_triggers_stop_short():
    by_epoch = Evaluator(freq_epochs=1)
    assert fired_steps(by_epoch, range(7), epoch_len=7) == []  # one 7-step epoch: no periodic firing
    assert by_epoch.final(step=7) and by_epoch.last_triggers == ("final",)
    assert not by_epoch.final(step=7)  # once
    by_steps = Evaluator(freq_steps=3)
    assert fired_steps(by_steps, range(30))[-1] == 27
    assert by_steps.final(step=30)
    fired_last = Evaluator(freq_steps=3)
    assert fired_steps(fired_last, range(31))[-1] == 30  # a loop that checks once more after the last update
    assert not fired_last.final(step=30)  # those weights were just evaluated
    restored = Evaluator(freq_steps=3)
    restored.load_state_dict(fired_last.state_dict())
    assert not restored.final(step=30)  # nor after a restart


def test_resuming_with_freq_epochs_newly_on_waits_for_the_next_epoch():
    before = Evaluator(freq_steps=100)  # the first run did not evaluate by epoch
    fired_steps(before, range(16), epoch_len=15)
    resumed = Evaluator(freq_epochs=1)
    resumed.load_state_dict(before.state_dict())
    assert fired_steps(resumed, range(16, 46), epoch_len=15) == [30, 45]  # epoch starts, not step 16
    old = {k: v for k, v in before.state_dict().items() if k not in ("seen_epoch", "evaluated_at")}
    from_old = Evaluator(freq_epochs=1)
    from_old.load_state_dict(old)  # a checkpoint written before the fix
    assert fired_steps(from_old, range(16, 46), epoch_len=15) == [30, 45]


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # The ranks' clocks disagree; rank 0 must decide for both.
    clock = iter({0: [0, 15, 16, 26, 27], 1: [0, 0, 30, 31, 100]}[rank]).__next__
    evaluator = Evaluator(freq_secs=10, clock=clock)
    secs = [evaluator.should_evaluate(step=s) for s in range(1, 5)]
    advised = Evaluator(freq_steps=100, control=Advice(3 if rank == 0 else None), interval_bounds=(1, 100))
    steps = [s for s in range(10) if advised.should_evaluate(step=s)]  # the advice reached rank 0 first
    results.put((rank, {"secs": secs, "steps": steps, "interval": advised.interval_steps}))
    dist.destroy_process_group()


def test_ranks_agree_over_gloo_when_clocks_and_advice_differ():
    import torch  # noqa: F401  imported before forking, so the ranks start in well under a second

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        outputs = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    # rank 0's clock fires at t=15 and t=26; rank 1 wanted t=30 and t=100 instead, and follows rank 0
    expected = {"secs": [True, False, True, False], "steps": [3, 6, 9], "interval": 3}
    assert outputs == {0: expected, 1: expected}
