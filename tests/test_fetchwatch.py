"""``FetchWatch``: a partition fetched past what Faust delivered, on an idle worker, is sought back
(issue 19: records dropped during a rebalance were never read again). Pure logic; the two-worker
test in test_kafka_faults.py is where it was seen."""

from __future__ import annotations

from rankwatch.stream_processors.fetchwatch import FetchWatch, Offsets

# What the survivor of a killed worker showed, stuck for good: fetched to the end, delivered nothing.
STUCK = Offsets(position=30, delivered=None, committed=16)


def test_a_partition_fetched_past_what_was_delivered_is_sought_back_on_the_second_idle_check():
    watch = FetchWatch()
    assert watch.check(idle=True, offsets={"p1": STUCK}) == []  # once could be records in passing
    assert watch.check(idle=True, offsets={"p1": STUCK}) == ["p1"]
    assert watch.check(idle=True, offsets={"p1": STUCK}) == []  # counted again from the seek


def test_a_busy_worker_or_a_moving_partition_is_never_called_stuck():
    watch = FetchWatch()
    watch.check(idle=True, offsets={"p1": STUCK})
    assert watch.check(idle=False, offsets={"p1": STUCK}) == []  # messages on their way: nothing can be told
    assert watch.check(idle=True, offsets={"p1": STUCK}) == []  # and the count starts over
    moved = Offsets(position=30, delivered=20, committed=16)
    assert watch.check(idle=True, offsets={"p1": moved}) == []  # it delivered since: not stuck


def test_partitions_read_to_their_end_are_never_behind():
    caught_up = [
        Offsets(position=15, delivered=14, committed=15),  # delivered everything, committed it
        Offsets(position=16, delivered=16, committed=16),  # just sought to 16 (delivered: the seek's target)
        Offsets(position=0, delivered=None, committed=None),  # an empty partition
        Offsets(position=None, delivered=None, committed=None),  # no position yet
    ]
    assert not any(o.behind() for o in caught_up)
    assert Offsets(position=45, delivered=1, committed=17).behind()
    watch = FetchWatch()
    offsets = {i: o for i, o in enumerate(caught_up)}
    assert watch.check(idle=True, offsets=offsets) == [] and watch.check(idle=True, offsets=offsets) == []


def test_a_partition_never_fetched_with_records_after_its_commit_is_sought_back_too():
    # What a restarted worker showed: position at the committed offset, records after it, nothing
    # delivered, idle for good.
    unread = Offsets(position=16, delivered=None, committed=16, end=30)
    assert unread.behind()
    watch = FetchWatch()
    assert watch.check(idle=True, offsets={"p1": unread}) == []
    assert watch.check(idle=True, offsets={"p1": unread}) == ["p1"]
    at_end = Offsets(position=30, delivered=29, committed=30, end=30)
    assert not at_end.behind()


def test_records_past_the_commit_of_an_idle_worker_are_read_again_whatever_faust_says_it_delivered():
    # Faust's fetch loop sets its delivered offset after a record it gave up in a rebalance, and
    # then skips every record below it: delivered says "read", the commit says otherwise.
    skipped = Offsets(position=20, delivered=19, committed=0, end=20)
    watch = FetchWatch()
    assert watch.check(idle=True, offsets={"p1": skipped}) == []
    assert watch.check(idle=True, offsets={"p1": skipped}) == ["p1"]


def test_acknowledged_records_waiting_for_their_commit_are_not_stuck():
    held = Offsets(position=15, delivered=14, committed=10)  # acks held for a state write
    assert held.behind()
    watch = FetchWatch()
    assert watch.check(idle=False, offsets={"p1": held}) == [] and watch.check(idle=False, offsets={"p1": held}) == []
    # Acknowledged: committed within Faust's commit interval, so the next check sees it move.
    assert watch.check(idle=True, offsets={"p1": held}) == []
    assert watch.check(idle=True, offsets={"p1": Offsets(position=15, delivered=14, committed=15)}) == []
