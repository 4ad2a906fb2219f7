"""Stage 2: one incident, one page (issue 18): the conditions of a run that start together are paged
as one alert, and a NaN's page holds back its symptoms (``inhibit``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rankwatch.contract import Alert, RankSignal
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import GROUPS_VERSION, GroupsStateError, RunGroups


def _metric_signal(metric: str, detector: str, status: str = "firing", *, incident: int = 120, step: int = 120,
                   severity: str = "critical", rank: int = 0, world: int = 1) -> RankSignal:
    alert = Alert(
        key=Alert.make_key("r", detector, metric, rank), run="r", status=status, severity=severity,
        detector=detector, metric=metric, rank=rank, step=step, value=float("nan"),
        message=f"{metric} is NaN on rank {rank} at step {step} ({detector})", ts=0.0, incident=incident, ranks=(rank,),
    )
    return RankSignal(alert=alert, world_size=world)


def test_a_nan_reaching_several_metrics_is_one_page_listing_them():
    grouper, state = Grouper(group_wait_s=0.0, group_interval_s=0.0), RunGroups()
    [first] = grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.0)
    assert first.metrics == () and first.key == "r/nonfinite/loss"
    [second] = grouper.add(state, _metric_signal("grad_norm", "nonfinite"), now=0.0)
    [third] = grouper.add(state, _metric_signal("param_norm", "nonfinite"), now=0.0)
    assert third.key == first.key == second.key and third.incident == 120
    assert third.metrics == ("loss", "grad_norm", "param_norm") and "3 metrics at step 120" in third.message
    # A warning on another detector of the same step joins it; the page keeps the highest severity.
    [fourth] = grouper.add(state, _metric_signal("update_ratio", "spike", severity="warning"), now=0.0)
    assert fourth.severity == "critical" and fourth.metrics[-1] == "update_ratio"
    # Members resolve silently until the last one; then one resolved alert closes the page.
    out = []
    for metric, det in (("loss", "nonfinite"), ("grad_norm", "nonfinite"), ("update_ratio", "spike")):
        out += grouper.add(state, _metric_signal(metric, det, "resolved", step=130), now=1.0)
    assert out == []
    [closed] = grouper.add(state, _metric_signal("param_norm", "nonfinite", "resolved", step=131), now=1.0)
    assert closed.status == "resolved" and closed.key == first.key and len(closed.metrics) == 4
    # A later incident is a page of its own, and so is one two steps after another's.
    assert grouper.add(state, _metric_signal("grad_norm", "nonfinite", incident=298, step=298), now=2.0)
    [later] = grouper.add(state, _metric_signal("loss", "nonfinite", incident=300, step=300), now=2.0)
    assert later.metrics == () and later.incident == 300


@pytest.mark.parametrize("first, then", [(("grad_norm", 120), ("loss", 121)), (("loss", 121), ("grad_norm", 120))])
def test_a_nan_whose_loss_follows_a_step_later_is_one_page_in_either_order(first, then):
    # The NaN batch's rank and the all-reduced gradient are NaN at step 120, the other ranks' loss at
    # 121 (their weights took the NaN update); which signal arrives first depends on the ranks' timing.
    grouper, state = Grouper(group_wait_s=0.0, group_interval_s=0.0), RunGroups()
    [opened] = grouper.add(state, _metric_signal(first[0], "nonfinite", incident=first[1], step=first[1]), now=0.0)
    [joined] = grouper.add(state, _metric_signal(then[0], "nonfinite", incident=then[1], step=then[1]), now=0.0)
    assert joined.key == opened.key and joined.metrics == (first[0], then[0])
    # The page keeps its first member's incident; its message names the step the NaN began.
    assert joined.incident == first[1] and "2 metrics at step 120" in joined.message


def test_pages_survive_the_state_round_trip():
    grouper, state = Grouper(group_wait_s=0.0, group_interval_s=0.0), RunGroups()
    grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.0)
    restored = RunGroups.from_dict(json.loads(json.dumps(state.to_dict())))
    [page] = grouper.add(restored, _metric_signal("grad_norm", "nonfinite"), now=0.0)
    assert page.metrics == ("loss", "grad_norm")
    assert Alert.from_bytes(page.to_bytes()) == page


def test_groups_of_another_layout_are_refused_never_misread():
    grouper, state = Grouper(group_wait_s=0.0), RunGroups()
    grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.0)
    stored = json.loads(json.dumps(state.to_dict()))
    assert stored["version"] == GROUPS_VERSION
    unversioned = {k: v for k, v in stored.items() if k != "version"}  # stored before versions: version 1
    assert RunGroups.from_dict(unversioned).to_dict() == stored
    with pytest.raises(GroupsStateError, match=rf"version 9; this worker reads version {GROUPS_VERSION} only"):
        RunGroups.from_dict({**stored, "version": 9})
    for group in stored["groups"].values():
        group["learned_later"] = 1  # a newer release's field
    with pytest.raises(GroupsStateError, match="does not fit this worker: TypeError.*learned_later"):
        RunGroups.from_dict(stored)


def test_a_page_names_the_rank_its_conditions_share():
    # A NaN in rank 2's batch: its loss is NaN on rank 2, the all-reduced gradient on every rank.
    grouper, state = Grouper(group_wait_s=10.0), RunGroups()
    grouper.add(state, _metric_signal("loss", "nonfinite", rank=2, world=4), now=0.0)
    out = [a for r in range(4) for a in grouper.add(state, _metric_signal("grad_norm", "nonfinite", rank=r, world=4), now=0.0)]
    out += grouper.tick(state, now=20.0)
    assert out and set(out[-1].metrics) == {"loss", "grad_norm"} and out[-1].ranks == (2,) and out[-1].rank == 2


def test_a_pages_message_says_which_ranks_it_covers_as_its_ranks_change():
    # As the demo showed it on a loaded machine: the all-reduced gradient pages ranks 0, 2 and 3
    # first; rank 2's loss joins (every metric is on rank 2 only), then rank 1's gradient. The
    # page's words followed none of it ("3 ranks (0, 2, 3) firing" beside ranks == (2,)).
    grouper, state = Grouper(group_wait_s=10.0), RunGroups()
    out = [a for r in (0, 2, 3) for a in grouper.add(state, _metric_signal("grad_norm", "nonfinite", rank=r, world=4),
                                                     now=0.0)]
    out += grouper.tick(state, now=20.0)
    assert [a.ranks for a in out] == [(0, 2, 3)]
    grouper.add(state, _metric_signal("loss", "nonfinite", rank=2, world=4), now=21.0)
    [joined] = grouper.tick(state, now=40.0)
    assert joined.ranks == (2,) and joined.metrics == ("grad_norm", "loss")
    assert joined.message == ("2 metrics at step 120 (grad_norm, loss) on 3 ranks (0, 2, 3), every metric on rank 2; "
                              "first: grad_norm is NaN on rank 0 at step 120 (nonfinite)")
    # The last rank in: due at once. The same origin, one rank more: said again, once the page's
    # interval since its last send has passed.
    assert grouper.add(state, _metric_signal("grad_norm", "nonfinite", rank=1, world=4), now=41.0) == []
    [grown] = grouper.tick(state, now=42.0)
    assert grown.ranks == (2,) and "on 4 ranks (0, 1, 2, 3), every metric on rank 2;" in grown.message
    assert grouper.tick(state, now=80.0) == []


def test_a_nan_in_one_ranks_batch_is_one_page_and_one_update_naming_that_rank():
    # The demo's NaN in rank 2's batch at step 120, as its signals reached stage 2 on a loaded host:
    # the lane's gradient on three ranks first, then rank 2's loss, the fourth rank's gradient, and
    # the other ranks' loss a step later (their weights took the NaN update). Four sends before;
    # now the first page at once and everything that joined within the interval in one update, and
    # the origin stays rank 2 though every rank's loss is NaN by then.
    grouper, state = Grouper(group_wait_s=1.0, urgent_wait_s=0.05, group_interval_s=2.0), RunGroups()
    out = [a for r in (0, 2, 3)
           for a in grouper.add(state, _metric_signal("grad_norm", "nonfinite", rank=r, world=4), now=0.0)]
    out += grouper.tick(state, now=1.0)
    assert [(a.metric, a.ranks) for a in out] == [("grad_norm", (0, 2, 3))]
    joins = [("loss", 2, 120), ("grad_norm", 1, 120), ("loss", 0, 121), ("loss", 1, 121), ("loss", 3, 121)]
    for i, (metric, rank, step) in enumerate(joins):
        now = 1.1 + 0.2 * i
        out += grouper.add(state, _metric_signal(metric, "nonfinite", rank=rank, incident=step, step=step, world=4),
                           now=now)
        grouper.progress(state, rank, step, 4, now)
        out += grouper.tick(state, now=now)
    assert len(out) == 1
    [update] = grouper.tick(state, now=3.0)
    assert update.key == out[0].key and update.ranks == (2,) and update.metrics == ("grad_norm", "loss")
    assert update.message.startswith("2 metrics at step 120 (grad_norm, loss) on 4 ranks (0, 1, 2, 3), every metric "
                                     "on rank 2;")
    assert grouper.tick(state, now=10.0) == [] and not state.waiting()


def _warning(metric: str, status: str = "firing", *, incident: int, step: int | None = None) -> RankSignal:
    return _metric_signal(metric, "crossrank" if "time" in metric else "spike", status, incident=incident,
                          step=incident if step is None else step, severity="warning")


def test_a_nan_page_holds_back_the_runs_later_warnings_while_it_fires():
    # After a NaN the weights are NaN: a rank computing on them slower than its peers, or the
    # throughput falling, is a symptom, not news. Such warnings wait for the NaN page to resolve.
    grouper, state = Grouper(group_wait_s=0.0, group_interval_s=0.0), RunGroups()
    [nan] = grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.0)
    assert grouper.add(state, _warning("compute_time_s", incident=132), now=1.0) == []
    # One that ends while the NaN page fires is never sent, nor its end.
    assert grouper.add(state, _warning("samples_per_s", incident=135), now=1.0) == []
    assert grouper.add(state, _warning("samples_per_s", "resolved", incident=135, step=140), now=1.5) == []
    # The NaN page resolves: what it held back and still fires goes out then, and ends as usual.
    out = grouper.add(state, _metric_signal("loss", "nonfinite", "resolved", step=150), now=2.0)
    assert [(a.detector, a.metric, a.status) for a in out] == [
        ("nonfinite", "loss", "resolved"), ("crossrank", "compute_time_s", "firing")]
    assert out[1].incident == 132 and out[1].ts == 2.0 and nan.key != out[1].key
    [end] = grouper.add(state, _warning("compute_time_s", "resolved", incident=132, step=160), now=3.0)
    assert (end.metric, end.status) == ("compute_time_s", "resolved")
    assert state.pages == {}


def test_only_a_critical_nan_or_explosion_before_it_holds_a_warning_back():
    def sent(grouper: Grouper, first: RankSignal) -> list[str]:
        state = RunGroups()
        out = grouper.add(state, first, now=0.0) + grouper.add(state, _warning("compute_time_s", incident=132), now=1.0)
        return [a.detector for a in out]

    nan = _metric_signal("loss", "nonfinite")
    assert sent(Grouper(), nan) == ["nonfinite"]
    assert sent(Grouper(), _metric_signal("loss", "explode")) == ["explode"]
    assert sent(Grouper(inhibit=False), nan) == ["nonfinite", "crossrank"]
    # A collapsing reward is critical but leaves the numbers sound: a straggler then is news.
    assert sent(Grouper(), _metric_signal("reward", "collapse")) == ["collapse", "crossrank"]
    # A NaN after a warning began takes nothing back; a later critical condition is never held.
    grouper, state = Grouper(), RunGroups()
    first = grouper.add(state, _warning("compute_time_s", incident=100), now=0.0)
    first += grouper.add(state, nan, now=1.0)
    first += grouper.add(state, _metric_signal("grad_norm", "explode", incident=140, step=140), now=2.0)
    assert [a.detector for a in first] == ["crossrank", "nonfinite", "explode"]
    # A warning that began before the NaN is news, though its group is flushed after the NaN page.
    grouper, state = Grouper(), RunGroups()
    late = grouper.add(state, nan, now=0.0) + grouper.add(state, _warning("compute_time_s", incident=107), now=1.0)
    assert [a.detector for a in late] == ["nonfinite", "crossrank"]


def _run_wide(detector: str, metric: str, status: str = "firing", *, incident: int, severity: str) -> RankSignal:
    alert = Alert(key=Alert.make_key("r", detector, metric), run="r", status=status, severity=severity,
                  detector=detector, metric=metric, rank=None, step=incident, value=float("nan"),
                  message=f"eval at step {incident}: {metric} ({detector})", ts=0.0, incident=incident)
    return RankSignal(alert=alert, world_size=1)


def test_a_nan_page_holds_back_the_evaluations_of_the_broken_weights_at_any_severity():
    # The next evaluation after a NaN finds every eval loss NaN (critical) and the accuracy down
    # (warning): both say what the NaN page said. A run-wide stall is news and goes out.
    grouper, state = Grouper(), RunGroups()
    [nan] = grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.0)
    assert grouper.add(state, _run_wide("eval_nonfinite", "loss", incident=200, severity="critical"), now=1.0) == []
    assert grouper.add(state, _run_wide("eval_regression", "acc", incident=200, severity="warning"), now=1.0) == []
    [stall] = grouper.add(state, _run_wide("stall", "steps", incident=210, severity="critical"), now=1.5)
    assert stall.detector == "stall"
    # Held state survives the changelog; the regression ends while held: never sent, nor its end.
    state = RunGroups.from_dict(json.loads(json.dumps(state.to_dict())))
    assert grouper.add(state, _run_wide("eval_regression", "acc", "resolved", incident=200, severity="warning"),
                       now=2.0) == []
    # The NaN page resolves while the eval loss is still NaN: that goes out then.
    out = grouper.add(state, _metric_signal("loss", "nonfinite", "resolved", step=300), now=3.0)
    assert [(a.detector, a.status, a.ts) for a in out] == [("nonfinite", "resolved", 3.0),
                                                           ("eval_nonfinite", "firing", 3.0)]
    assert out[1].key == "r/eval_nonfinite/loss" and out[1].incident == 200
    [end] = grouper.add(state, _run_wide("eval_nonfinite", "loss", "resolved", incident=200, severity="critical"),
                        now=4.0)
    assert (end.detector, end.status) == ("eval_nonfinite", "resolved") and state.held == {}
    # Without inhibit, or before any NaN, an evaluation's alert goes out as it comes.
    for grouper, first in ((Grouper(inhibit=False), [_metric_signal("loss", "nonfinite")]), (Grouper(), [])):
        state = RunGroups()
        out = [a for s in first for a in grouper.add(state, s, now=0.0)]
        out += grouper.add(state, _run_wide("eval_nonfinite", "loss", incident=200, severity="critical"), now=1.0)
        assert out[-1].detector == "eval_nonfinite"


def test_a_page_that_turns_critical_is_sent_at_once_within_its_interval():
    # A spike on the gradient at step 119, then the NaN at 120: the NaN joins the spike's page, and
    # a page held for its interval would page the NaN up to two seconds late.
    grouper, state = Grouper(group_interval_s=2.0), RunGroups()
    [spike] = grouper.add(state, _warning("grad_norm", incident=119), now=0.0)
    [nan] = grouper.add(state, _metric_signal("loss", "nonfinite"), now=0.1)
    assert (spike.severity, nan.severity, nan.key) == ("warning", "critical", spike.key)
    assert nan.metrics == ("grad_norm", "loss") and not state.waiting()


@pytest.mark.parametrize("seed", range(200))
def test_random_incidents_every_page_sent_is_resolved_once_and_symptoms_wait(seed):
    # Conditions of several detectors and severities fire and resolve on several ranks in random
    # order, with progress and ticks between. Whatever the interleaving: each key's sends alternate
    # firing and resolved and end resolved, a held update or held-back page never outlives its run's
    # incidents, and no warning goes out while a NaN page that began before it fires.
    import random

    rng = random.Random(seed)
    world = rng.choice([1, 2, 4])
    kinds = [("loss", "nonfinite", "critical"), ("grad_norm", "nonfinite", "critical"),
             ("grad_norm", "spike", "warning"), ("compute_time_s", "crossrank", "warning"),
             ("samples_per_s", "spike", "warning"), ("reward", "collapse", "critical")]
    events = []  # (step, order, signal)
    for metric, detector, severity in rng.sample(kinds, rng.randint(1, len(kinds))):
        for rank in rng.sample(range(world), rng.randint(1, world)):
            step = rng.randint(0, 40)
            for _ in range(rng.randint(1, 3)):
                end = step + rng.randint(1, 30)
                for status, at in (("firing", step), ("resolved", end)):
                    signal = _metric_signal(metric, detector, status, incident=step, step=at, severity=severity,
                                            rank=rank, world=world)
                    events.append((at, rng.random(), signal))
                step = end + rng.randint(1, 20)
    events.sort(key=lambda e: e[:2])
    grouper, state = Grouper(group_wait_s=rng.choice([0.0, 1.0]), group_interval_s=rng.choice([0.0, 2.0])), RunGroups()
    sent: list[Alert] = []
    firing: dict[str, Alert] = {}  # key -> the last firing alert sent, while it fires

    def record(alerts: list[Alert]) -> None:
        for a in alerts:
            if a.status == "firing":
                if a.severity != "critical" and a.key not in firing:
                    nan_pages = [f for f in firing.values() if f.detector == "nonfinite" and f.incident <= a.incident]
                    assert not nan_pages, f"{a.key} at {a.incident} sent while {nan_pages[0].key} fires"
                firing[a.key] = a
            else:
                assert a.key in firing, f"{a.key} resolved but never sent firing"
                del firing[a.key]
            sent.append(a)

    now = 0.0
    for step, _, signal in events:
        now += rng.choice([0.01, 0.3, 1.5])
        record(grouper.add(state, signal, now))
        for rank in range(world):
            record(grouper.progress(state, rank, step, world, now))
        record(grouper.tick(state, now))
    record(grouper.tick(state, now + 100.0))
    assert firing == {} and state.pages == {} and not state.waiting()
    assert sent and sent[-1].status == "resolved"


@pytest.mark.parametrize("order", [(1, 3, 0, 2), (2, 1, 3, 0), (2, 1, 3)])
def test_a_nan_whose_lane_records_arrive_together_is_one_page_naming_its_rank(order):
    # The lane's records of an all-reduced NaN within the 50 ms urgent wait: rank 2's loss and
    # gradient, the other ranks' gradient, in any order, with or without the last one. Before, the
    # group that became due first made the page, and the other an update held for the interval: the
    # page went out without the loss and without naming rank 2.
    grouper, state = Grouper(urgent_wait_s=0.05, group_interval_s=2.0), RunGroups()

    def lane(metric: str, rank: int) -> RankSignal:
        alert = _metric_signal(metric, "nonfinite", rank=rank, world=4).alert
        return RankSignal(alert=alert, world_size=4, urgent=True)

    out = []
    for rank in order:
        out += grouper.add_all(state, [lane(m, rank) for m in (("loss", "grad_norm") if rank == 2 else ("grad_norm",))],
                               now=0.01 * len(out))
    out += grouper.tick(state, now=0.1)
    [page] = out
    assert set(page.metrics) == {"grad_norm", "loss"} and page.ranks == (2,)
    assert f"on {len(order)} ranks" in page.message and "every metric on rank 2" in page.message
    # The other ranks' loss a step later leaves the origin; it is an update only where it brings a
    # rank the page did not cover (rank 0, when its gradient was not in yet).
    late = [_metric_signal("loss", "nonfinite", rank=r, incident=121, step=121, world=4) for r in (0, 1, 3)]
    updates = grouper.add_all(state, late, now=0.5) + grouper.tick(state, now=5.0)
    assert [(u.ranks, "on 4 ranks (0, 1, 2, 3)" in u.message) for u in updates] == ([] if len(order) == 4
                                                                                   else [((2,), True)])


def test_a_page_that_one_signal_of_a_message_completes_carries_the_others():
    # Stage 1's signals of one message reach stage 2 together (``SignalBatch``). The NaN in rank 2's
    # batch makes its gradient (every rank's, all-reduced) and its loss NaN; when rank 2 is the last
    # to report, its gradient completes the gradient's group. Applied one by one, that paged every
    # rank's gradient, and only an update named rank 2 (in 1 of 2 NaN scenarios on fresh seeds).
    grouper = Grouper(group_wait_s=10.0, group_interval_s=2.0)
    rank2 = [_metric_signal(m, "nonfinite", rank=2, world=4) for m in ("grad_norm", "loss")]

    def others_then(apply) -> list[Alert]:
        state = RunGroups()
        for rank in (0, 1, 3):
            assert grouper.add(state, _metric_signal("grad_norm", "nonfinite", rank=rank, world=4), now=0.0) == []
        return apply(state)

    [page] = others_then(lambda state: grouper.add_all(state, rank2, now=0.1))
    assert page.metrics == ("grad_norm", "loss") and page.ranks == (2,) and "every metric on rank 2" in page.message
    one_by_one = others_then(lambda state: [a for s in rank2 for a in grouper.add(state, s, now=0.1)])
    assert [(a.metrics, a.ranks) for a in one_by_one] == [((), (0, 1, 2, 3))]


def test_signals_applied_together_keep_each_groups_order_and_the_inhibitor():
    grouper = Grouper(group_wait_s=0.0, group_interval_s=0.0)
    # The last rank's condition fires and ends within one message: the page it completed names it.
    state = RunGroups()
    assert grouper.add(state, _metric_signal("loss", "nonfinite", rank=0, world=2), now=0.0) == []
    burst = [_metric_signal("loss", "nonfinite", rank=1, world=2),
             _metric_signal("loss", "nonfinite", "resolved", rank=1, step=126, world=2)]
    assert [(a.status, a.ranks) for a in grouper.add_all(state, burst, now=0.0)] == [("firing", (0, 1))]
    # A NaN page completed in a message holds back the run-wide warning that follows it there.
    state = RunGroups()
    out = grouper.add_all(state, [_metric_signal("loss", "nonfinite"),
                                  _run_wide("spike", "eval_loss", incident=121, severity="warning")], now=0.0)
    assert [a.detector for a in out] == ["nonfinite"] and state.pages


def test_latest_keeps_a_decisions_last_version_of_each_page():
    from rankwatch.stream_processors.grouping import latest

    def alert(key: str, status: str = "firing", message: str = "") -> Alert:
        return replace(_metric_signal("loss", "nonfinite", status).alert, key=key, message=message)

    v1, v2, other, end = alert("a", message="v1"), alert("a", message="v2"), alert("b"), alert("a", "resolved")
    assert [id(a) for a in latest([v1, other, v2])] == [id(other), id(v2)]
    assert [id(a) for a in latest([v1, end, v2])] == [id(v1), id(end), id(v2)]  # two incidents of one key


def test_a_page_names_no_origin_from_conditions_that_began_after_its_first_step():
    # As a demo run on a loaded host had it: the others' NaN gradient (step 120) and their NaN loss
    # (step 121, from the NaN update) reached stage 2 before rank 2's own signals. The loss began a
    # step after the page, so it says nothing of the origin: the page named ranks 1 and 3.
    grouper, state = Grouper(group_wait_s=0.0, group_interval_s=0.0), RunGroups()

    def send(metric: str, ranks: tuple[int, ...], step: int, now: float) -> Alert:
        signals = [_metric_signal(metric, "nonfinite", rank=r, incident=step, step=step, world=4) for r in ranks]
        [page] = grouper.add_all(state, signals, now) + grouper.tick(state, now)
        return page

    send("grad_norm", (0, 1, 3), 120, now=0.0)
    page = send("loss", (1, 3), 121, now=0.1)
    assert page.ranks == (0, 1, 3) and "every metric" not in page.message
    page = send("loss", (2,), 120, now=0.2)  # no rank is in both conditions at step 120 yet
    assert page.ranks == (0, 1, 2, 3) and "every metric" not in page.message
    page = send("grad_norm", (2,), 120, now=0.3)
    assert page.ranks == (2,) and "on 4 ranks (0, 1, 2, 3), every metric on rank 2" in page.message
