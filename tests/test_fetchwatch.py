"""Records Faust fetched but never gave a stream are read again: at once by the consumer, or by
``FetchWatch``, which seeks back a partition with records past its commit and none in flight
(issue 19: records dropped during a rebalance were never read again). Pure logic; the Kafka fault
tests in test_kafka_faults.py are where it was seen."""

from __future__ import annotations

from collections import defaultdict, namedtuple
from types import SimpleNamespace

from faust.transport.drivers import aiokafka as faust_aiokafka
from intervaltree import IntervalTree

from rankwatch.stream_processors import consumer, kafka_transport, tansu
from rankwatch.stream_processors.consumer import InOrder, not_handed_over
from rankwatch.stream_processors.fetchwatch import FetchWatch, Offsets, refetch

# What the survivor of a killed worker showed, stuck for good: fetched to the end, delivered nothing.
STUCK = Offsets(position=30, delivered=None, committed=16)
IDLE: set = set()


def _checks(watch: FetchWatch, offsets: dict, n: int, busy=IDLE) -> list[list]:
    return [watch.check(busy=busy, offsets=offsets) for _ in range(n)]


def test_a_partition_fetched_past_its_commit_is_sought_back_once_seen_so_for_patience_checks():
    watch = FetchWatch()
    *before, at = _checks(watch, {"p1": STUCK}, watch.patience)
    assert before == [[]] * (watch.patience - 1) and at == ["p1"]  # sooner could be a commit on its way (2.8 s)
    assert watch.check(busy=IDLE, offsets={"p1": STUCK}) == []  # counted again from the seek


def test_a_partition_with_records_in_flight_or_moving_is_never_called_stuck():
    watch = FetchWatch(patience=2)
    watch.check(busy=IDLE, offsets={"p1": STUCK})
    assert watch.check(busy={"p1"}, offsets={"p1": STUCK}) == []  # records on their way: nothing can be told
    assert watch.check(busy=IDLE, offsets={"p1": STUCK}) == []  # and the count starts over
    moved = Offsets(position=30, delivered=20, committed=20)
    assert watch.check(busy=IDLE, offsets={"p1": moved}) == []  # it committed since: not stuck


def test_a_busy_partition_does_not_hide_a_stuck_one():
    # Acknowledgements wait for state writes (every few seconds): a worker under steady load always has
    # some partition busy, and a stuck one must still be found.
    watch = FetchWatch(patience=2)
    offsets = {"p1": STUCK, "p2": Offsets(position=50, delivered=49, committed=40)}
    assert _checks(watch, offsets, 2, busy={"p2"}) == [[], ["p1"]]


def test_partitions_read_to_their_end_are_never_behind():
    caught_up = [
        Offsets(position=15, delivered=14, committed=15),  # delivered everything, committed it
        Offsets(position=16, delivered=16, committed=16),  # just sought to 16 (delivered: the seek's target)
        Offsets(position=0, delivered=None, committed=None),  # an empty partition
        Offsets(position=None, delivered=None, committed=None),  # no position yet
    ]
    assert not any(o.behind() for o in caught_up)
    assert Offsets(position=45, delivered=1, committed=17).behind()
    watch = FetchWatch(patience=2)
    offsets = {i: o for i, o in enumerate(caught_up)}
    assert _checks(watch, offsets, 3) == [[], [], []]


def test_a_partition_never_fetched_with_records_after_its_commit_is_sought_back_too():
    # What a restarted worker showed: position at the committed offset, records after it, nothing
    # delivered, idle for good.
    unread = Offsets(position=16, delivered=None, committed=16, end=30)
    assert unread.behind()
    assert _checks(FetchWatch(patience=2), {"p1": unread}, 2) == [[], ["p1"]]
    assert not Offsets(position=30, delivered=29, committed=30, end=30).behind()


def test_records_past_the_commit_are_read_again_whatever_faust_says_it_delivered():
    # Faust's fetch loop sets its delivered offset after a record it gave up in a rebalance, and
    # then skips every record below it: delivered says "read", the commit says otherwise.
    skipped = Offsets(position=20, delivered=19, committed=0, end=20)
    assert _checks(FetchWatch(patience=2), {"p1": skipped}, 2) == [[], ["p1"]]


def test_acknowledged_records_waiting_for_their_commit_are_not_stuck():
    held = Offsets(position=15, delivered=14, committed=10)  # acks held for a state write
    assert held.behind()
    watch = FetchWatch(patience=2)
    assert _checks(watch, {"p1": held}, 3, busy={"p1"}) == [[], [], []]
    # Acknowledged: committed within Faust's commit interval, so a later check sees it move.
    assert watch.check(busy=IDLE, offsets={"p1": held}) == []
    assert watch.check(busy=IDLE, offsets={"p1": Offsets(position=15, delivered=14, committed=15)}) == []


def test_the_records_of_a_batch_not_handed_over_start_after_the_last_one_that_was():
    record = namedtuple("record", "offset")
    batch = {"p0": [record(o) for o in range(10, 15)], "p1": [record(o) for o in range(3, 6)],
             "p2": [record(o) for o in range(7, 9)]}
    # p0 stopped half way (a rebalance began), p1 was skipped (not active), p2 went through whole.
    assert not_handed_over(batch, {"p0": 11, "p2": 8}) == {"p0": 12, "p1": 3}


def test_both_transports_consume_with_the_consumer_that_fetches_dropped_records_again():
    assert issubclass(tansu.Transport.Consumer, consumer.Consumer)
    assert issubclass(kafka_transport.Transport.Consumer, consumer.Consumer)


def _fetch_sets(active=(), paused=(), buffered=()):
    return SimpleNamespace(_active_partitions=set(active), _paused_partitions=set(paused),
                           _buffered_partitions=set(buffered))


def test_a_stuck_partition_left_out_of_the_fetched_set_is_put_back():
    # A stream's buffer filled (the partition left the set), then a rebalance emptied the buffer
    # without the drain that puts it back: aiokafka is never asked for its records again.
    held = _fetch_sets(active={"p0"}, buffered={"p1"})
    assert refetch(held, "p1") == "held as buffered from the partitions Faust fetches"
    assert held._active_partitions == {"p0", "p1"} and held._buffered_partitions == set()
    lost = _fetch_sets(active={"p0"})
    assert refetch(lost, "p1") == "missing from the partitions Faust fetches"
    assert lost._active_partitions == {"p0", "p1"}


def test_a_fetched_or_paused_partition_is_left_as_it_is():
    fetched = _fetch_sets(active={"p0", "p1"})
    assert refetch(fetched, "p1") is None and fetched._active_partitions == {"p0", "p1"}
    paused = _fetch_sets(active={"p0"}, paused={"p1"})  # a table recovering: Faust resumes it when done
    assert refetch(paused, "p1") is None and paused._active_partitions == {"p0"}


def _offsets_after_acks(cls, *, committed, acked, first_fetched=None, gaps=()):
    """What ``cls._new_offset`` would commit for partition "p": Faust's bookkeeping, nothing else."""
    state = object.__new__(cls)
    state._committed_offset = defaultdict(lambda: None, p=committed)
    state._acked = defaultdict(list, p=list(acked))
    state._acked_index = defaultdict(set, p=set(acked))
    state._gap = defaultdict(IntervalTree, p=IntervalTree.from_tuples(gaps))
    state._first_fetched = {} if first_fetched is None else {"p": first_fetched}
    return cls._new_offset(state, "p")


def test_a_commit_never_passes_the_next_record_while_it_is_unacknowledged():
    # Offset 31 is next; 32 and 33 are acknowledged (another rank's state was written first, or a
    # rebalance made Faust drop 31). Faust's own bookkeeping commits 34: 31 would never be read
    # again (faust#606; if this line fails, faust-streaming fixed it and the override can go).
    assert _offsets_after_acks(faust_aiokafka.Consumer, committed=31, acked=[32, 33]) == 34
    assert _offsets_after_acks(consumer.Consumer, committed=31, acked=[32, 33]) is None
    # Nothing committed yet (Faust keeps 0 as None): the head is the first offset fetched.
    assert _offsets_after_acks(faust_aiokafka.Consumer, committed=None, acked=[1, 2]) == 3
    assert _offsets_after_acks(consumer.Consumer, committed=None, acked=[1, 2], first_fetched=0) is None
    # Once the head is acknowledged, or is a gap in the log, the run commits as before.
    assert _offsets_after_acks(consumer.Consumer, committed=31, acked=[31, 32, 34]) == 33
    assert _offsets_after_acks(consumer.Consumer, committed=None, acked=[0, 1, 2], first_fetched=0) == 3
    assert _offsets_after_acks(consumer.Consumer, committed=31, acked=[32, 33], gaps=[(31, 32)]) == 34


def test_a_partitions_records_go_to_a_stream_in_order_or_wait_for_the_seek_back():
    # Faust skipped p0's 12 and 13 (inactive, most likely its buffer full) and handed over 14 and 15
    # once it was active again; p1 went through whole.
    record = namedtuple("record", "offset")
    batch = {"p0": [record(o) for o in range(10, 16)], "p1": [record(o) for o in range(3, 6)]}
    order = InOrder(batch)
    yielded = [("p0", 10), ("p1", 3), ("p0", 11), ("p1", 4), ("p0", 14), ("p1", 5), ("p0", 15)]
    assert [(tp, o) for tp, o in yielded if order.allows(tp, o)] == [("p0", 10), ("p1", 3), ("p0", 11), ("p1", 4),
                                                                      ("p1", 5)]
    assert not_handed_over(batch, order.handed) == {"p0": 12}  # sought back there, in order from then on
    skipped_first = InOrder(batch)
    assert not skipped_first.allows("p0", 11) and not skipped_first.allows("p0", 10)
    assert not_handed_over(batch, skipped_first.handed) == {"p0": 10, "p1": 3}
