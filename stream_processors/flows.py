"""Stream functions: decode, call pure code, send. Nothing here decides anything."""

from __future__ import annotations

import asyncio
import logging
import time

import faust

from rankwatch import contract
from rankwatch.contract import (
    ProgressBatch, RankSignal, SignalBatch, TelemetryBatch, UrgentTelemetry, decode_run_event,
)
from rankwatch.settings import Settings
from rankwatch.stream_processors.alert_sender import AlertSender, AlertSenderClosed, Paging
from rankwatch.stream_processors.batching import process_in_parts
from rankwatch.stream_processors.clocks import LagWatch, OutageClock
from rankwatch.stream_processors.grouping import Grouper, latest
from rankwatch.stream_processors.groups import GroupsStateError, RunGroups
from rankwatch.stream_processors.lane import LanePager, LaneReader
from rankwatch.stream_processors.processor import TelemetryProcessor
from rankwatch.stream_processors.rules import Rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher, WatchStateError, tick_mark
from rankwatch.stream_processors.state_writes import StateWrites
from rankwatch.stream_processors.tables import is_part
from rankwatch.stream_processors.topics import dead_letterer, decoded, encoded, raw_topic, send_all
from rankwatch.stream_processors.urgent import urgent_signals

log = logging.getLogger(__name__)

# Stage 1 takes telemetry in batches (issue 16): per-message costs (Faust's per-event work, a state
# write, a progress event) dominate at cluster scale. A batch is sent after TAKE_WITHIN_S, or at once
# when TAKE_MAX messages are waiting, so it adds at most TAKE_WITHIN_S to an alert's latency. A take
# is processed STAGE1_PART messages at a time with the event loop let in between: whole, it held the
# loop for 0.2-1.3 s when its windows closed or its detectors refitted, and the NaN lane's pages
# and stage 2 waited meanwhile.
TAKE_MAX = 100
TAKE_WITHIN_S = 0.02
STAGE1_PART = 5


async def _each(items):
    for item in items:
        yield item


def _progress(grouper: Grouper, state: RunGroups, observed: list, now: float) -> list:
    """Stage 1's progress of each rank and the cross-rank alerts it brought, applied in order."""
    due = []
    for p, found in observed:
        due += grouper.progress(state, p.rank, p.last_step, p.world_size, now, restarted=p.restarted)
        due += grouper.add_all(state, [RankSignal(alert=alert, world_size=p.world_size) for alert in found], now)
    return latest(due)


def register(app: faust.App, settings: Settings, *, outages: OutageClock) -> None:
    telemetry = raw_topic(app, contract.TELEMETRY)
    alerts = raw_topic(app, contract.ALERTS)
    reports = raw_topic(app, contract.REPORTS)
    run_events = raw_topic(app, contract.RUN_EVENTS)
    out_topics = {contract.ALERTS: alerts, contract.REPORTS: reports, contract.RUN_EVENTS: run_events}
    rules = Rules.load(settings.rules or None)
    # Stage 1: one value per (run, rank), keyed like the telemetry topic, so each key has one writer.
    # Written inside stream.take, which needs the partitioner (Tansu note 9); bytes keys, as on the
    # telemetry topic, put each rank's state on its stream's partition.
    rank_state = app.Table("rank-state", default=None, key_type=bytes, use_partitioner=True)
    # Stage 2: one value per run. Bytes keys + the partitioner put each run's state on the partition
    # its run-events go to, which the group-wait timer needs (it writes outside stream iteration).
    run_state = app.Table("run-state", default=None, key_type=bytes, use_partitioner=True)
    processor = TelemetryProcessor(rollup_steps=settings.rollup_steps, rules=rules)
    grouper = Grouper.from_rules(rules)
    waiting: set[bytes] = set()  # runs with groups inside their wait, on partitions this worker owns
    # Stage 2's alerts go out in the order decided, from the loop and from the lane's thread (``alert_sender``).
    sender = AlertSender(settings.bootstrap, settings.security.kafka_python())
    paging = Paging(sender, encoded)
    pager = LanePager(  # the lane's pages, on its reader's thread; ``read_lane`` connects it to the loop
        rules=rules, grouper=grouper, paging=paging, ready=lambda: not (app.rebalancing or app.in_recovery),
        groups_of=lambda key: state if isinstance(state := run_state.data.get(key), RunGroups) else None)
    watcher = RunWatcher(rules=rules, outages=outages)  # stopped while the broker is away or the worker behind
    # Per run: cross-rank rows and stall clocks, keyed and partitioned like run-state, so the worker
    # that gets a run's partition next (a rebalance, a crash) recovers them from the changelog instead
    # of starting blank (issue 16). Written through ``watches``, like rank state.
    run_watch = app.Table("run-watch", default=None, key_type=bytes, use_partitioner=True)

    def load_watch(raw, run: str, partition: int) -> RunWatch:
        if isinstance(raw, RunWatch):  # the memory store keeps the object written
            watch = raw
        elif raw is None:
            watch = RunWatch(run=run)
        else:  # recovered from the changelog as a dict
            try:
                watch = RunWatch.from_dict(raw, rules=rules, clock=watcher.outages.read(time.time()))
            except WatchStateError as exc:  # never misread; a few steps of warm-up rebuild it
                log.error("run %s: %s; its cross-rank and stall watch starts over", run, exc)
                watch = RunWatch(run=run)
        watch.partition = partition
        return watch

    dead_letter = dead_letterer(app)
    lags = LagWatch()  # whether the worker is behind on what it reads; stall silences stop meanwhile

    def processed(events, now: float) -> None:
        for event in events:
            message = event.message
            lags.processed(message.tp, message.offset, message.timestamp, now)

    # A rank's state goes to its changelog at most every ``state_write_s``, not per batch (``state_writes``).
    unwritten = StateWrites(rank_state, settings.state_write_s)
    watches = StateWrites(run_watch, settings.state_write_s)  # 169 KB a run at 1,024 ranks, changed by every run event

    def write_states() -> None:
        # A rebalance or a stop waits for every ack (Faust's ``wait_empty``) before it hands
        # partitions over or commits: then nothing waits for the interval, nor for the loop.
        now = time.monotonic()
        for writes in (unwritten, watches):
            if writes.due(now, now_anyway=True):
                writes.write(now)

    async def write_due_states() -> None:
        if app.rebalancing or app.should_stop:
            return write_states()
        now = time.monotonic()
        for writes in (unwritten, watches):
            if writes.due(now):
                await writes.write_gradually(now)

    app.before_ack_wait.append(write_states)

    @app.agent(telemetry, name="telemetry")
    async def process_telemetry(stream):
        async for events in stream.noack_take(TAKE_MAX, within=TAKE_WITHIN_S):
            good = [(e, b) async for e, b in decoded(_each(events), TelemetryBatch.from_bytes, dead_letter, "telemetry")]
            for out in process_in_parts(processor, [b for _, b in good], lambda key: unwritten.get(key.encode()),
                                        time.time(), [e.message.partition for e, _ in good], part=STAGE1_PART):
                await asyncio.sleep(0)  # the NaN lane and stage 2 run between parts
            if out.unreadable:  # once per rank: its fresh state is the one read from now on
                key, exc = out.unreadable[0]
                log.error("%d ranks' stored state could not be read, e.g. %s: %s; they keep their place in the "
                          "stream and learn afresh", len(out.unreadable), key, exc)
            if out.late:  # a delivery out of order (``late``): rare, and worth a trace when it is not
                key, seq = out.late[0]
                log.warning("%d messages came after later ones of their rank, e.g. %s seq %d: rolled up late",
                            len(out.late), key, seq)
            for index, exc in out.failed:  # a bug must not stop the worker; the message is kept
                event = good[index][0]
                log.error("processing %s[%d]@%d failed", event.message.topic, event.message.partition,
                          event.message.offset, exc_info=exc)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")
            await send_all(out_topics, out.messages)
            unwritten.add(events, {key.encode(): state for key, state in out.states.items()})  # after the output
            await write_due_states()
            processed(events, time.time())

    async def apply_urgent(batch: UrgentTelemetry, partition: int) -> None:
        """The lane's signals grouped on the run's partition, on the loop."""
        key, now = batch.run.encode(), time.time()
        signals = urgent_signals(rules, batch, now)
        if partition != run_state.partition_of(key):
            # Not co-partitioned with run events (a topic made by hand with another count): the
            # signals go to the run's owner, in order with the run's other events.
            await send_all(out_topics, encoded(*signals))
            return
        state = run_groups(key)
        pager.partitions[key] = partition  # the lane's thread pages this run from now on
        await sent(paging.decide(grouper.add_all, state, signals, now))
        keep(key, state)

    def keep(key: bytes, state: RunGroups, write: bool = True) -> None:
        """A run's groups, once their alerts are in: to the changelog (``write``: they changed), and to
        the flush timer while a group waits."""
        with paging.lock:
            if write:
                run_state[key] = state
            if state.waiting():
                waiting.add(key)
            else:
                waiting.discard(key)

    @app.agent(raw_topic(app, contract.URGENT), name="urgent")
    async def process_urgent(stream):
        # The NaN lane (``urgent``), grouped here: behind the run's progress on its run-events
        # partition, it would wait for the telemetry backlog it exists to skip. ``read_lane`` gets
        # most records first; this agent applies the rest and is the one that commits.
        async for event, batch in decoded(stream.events(), UrgentTelemetry.from_bytes, dead_letter, "urgent telemetry"):
            with paging.lock:
                mine = pager.marks.by_agent(event.message.partition, event.message.offset)
            if not mine:
                continue
            try:
                await apply_urgent(batch, event.message.partition)
            except AlertSenderClosed:
                raise  # the worker is stopping: the record stays unacknowledged
            except Exception as exc:  # a bug must not stop the worker; the message is kept
                log.exception("urgent %s[%d]@%d failed", event.message.topic, event.message.partition,
                              event.message.offset)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")

    @app.task
    async def read_lane():
        # The lane from a consumer of its own (``lane.py``): Faust's consumer would hand its records
        # out behind the telemetry fetched beside them.
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def kept(key: bytes, state: RunGroups, out) -> None:  # on the reader's thread
            def done(future) -> None:
                if future is None or future.exception() is None:  # else the worker is stopping: stage 1 pages it
                    keep(key, state)
            if out is None:
                loop.call_soon_threadsafe(done, None)
            else:
                out.add_done_callback(lambda future: loop.call_soon_threadsafe(done, future))

        pager.connect(lambda *record: loop.call_soon_threadsafe(queue.put_nowait, record), kept)
        reader = LaneReader(settings.bootstrap, contract.URGENT, pager.deliver, settings.security.kafka_python(),
                            tick=pager.tick)
        reader.start()
        try:
            while True:
                if not app.rebalancing:
                    reader.wanted = frozenset(owned(contract.URGENT))
                try:
                    partition, offset, value = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    continue
                if app.rebalancing or app.in_recovery:
                    continue  # the run's state may not be here yet: the agent applies it
                try:
                    batch = UrgentTelemetry.from_bytes(value)
                except Exception:  # noqa: BLE001 (the agent dead-letters it, with why)
                    continue
                with paging.lock:
                    mine = pager.marks.by_reader(partition, offset)
                if not mine:
                    continue
                try:
                    await apply_urgent(batch, partition)
                except AlertSenderClosed:
                    raise  # the worker is stopping
                except Exception:  # noqa: BLE001 (the agent applies it again, and dead-letters it if it fails there)
                    log.exception("urgent %s[%d]@%d failed on the lane's own reader", contract.URGENT, partition, offset)
                    with paging.lock:
                        pager.marks.release(partition, offset)
        finally:
            await loop.run_in_executor(None, reader.stop)
            await loop.run_in_executor(None, sender.close)

    @app.timer(interval=0.5)
    async def write_rank_states():  # a quiet stream must not hold its acks
        await write_due_states()

    async def sent(out) -> None:
        """Wait for the alerts of a decision (``Paging.decide``) to be in."""
        if out is not None:
            await asyncio.wrap_future(out)

    def run_groups(key: bytes) -> RunGroups:
        with paging.lock:
            state = run_state.get(key)
            if not isinstance(state, RunGroups):  # first sight, or recovered from the changelog as a dict
                try:
                    state = RunGroups.from_dict(state)
                except GroupsStateError as exc:  # never misread; a firing group then resolves unseen
                    log.error("run %s: %s; its alert groups start over", key.decode(errors="replace"), exc)
                    state = RunGroups()
                run_state[key] = state  # the memory store keeps this object; progress lives on it
            return state

    @app.agent(run_events, name="run-events")
    async def group_signals(stream):
        async for event in stream.noack().events():  # acked once the run's watch is written
            changed = await group_signal(event)
            watches.add([event], changed)
            await write_due_states()
            processed([event], time.time())

    async def group_signal(event) -> dict:
        """Group one run event; the run's watch, if it changed, to write."""
        async for event, item in decoded(_each([event]), decode_run_event, dead_letter, "run event"):
            watch = None
            try:
                state, now = run_groups(item.key), time.time()
                pager.partitions[item.key] = event.message.partition  # the lane's, co-partitioned
                signal = isinstance(item, (RankSignal, SignalBatch))
                if isinstance(item, RankSignal):
                    out = paging.decide(grouper.add, state, item, now)
                elif isinstance(item, SignalBatch):
                    out = paging.decide(grouper.add_all, state, list(item.items), now)
                else:
                    watch = load_watch(watches.get(item.key), item.run, event.message.partition)
                    # Cross-rank rows outside the lock, which the lane's thread may be waiting for.
                    observed = [(p, watcher.observe(watch, p, now))
                                for p in (item.items if isinstance(item, ProgressBatch) else (item,))]
                    out = paging.decide(_progress, grouper, state, observed, now)
            except Exception as exc:  # a bug must not stop the worker; the message is kept
                log.exception("grouping run event %s[%d]@%d failed", event.message.topic, event.message.partition,
                              event.message.offset)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")
                return {}
            await sent(out)
            # After the alerts are in: a worker killed in between sends them again on replay (at
            # least once), never loses them.
            keep(item.key, state, write=out is not None or signal)
            return {} if watch is None else {item.key: watch}  # written after its alerts are in, like run_state
        return {}  # dead-lettered

    @app.timer(interval=max(0.01, min(grouper.group_wait_s, grouper.urgent_wait_s) / 2))
    async def flush_waiting_groups():
        now = time.time()
        for key in list(waiting):
            state = run_groups(key)
            out = paging.decide(grouper.tick, state, now)
            await sent(out)
            keep(key, state, write=out is not None)

    def owned(topic: str) -> set[int]:
        return {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topic}

    def note_lag(now: float) -> None:
        """Stop the clock of stall silences while the worker is behind on telemetry or run events."""
        consumer = app.consumer
        read = [tp for tp in consumer.assignment() if tp.topic in (contract.TELEMETRY, contract.RUN_EVENTS)]
        lags.forget(set(read))
        ends = {}
        for tp in read:
            try:
                ends[tp] = consumer.highwater(tp)  # as the last fetch saw it: no request
            except Exception:  # noqa: BLE001 (assignment changing under us: not known this time)
                ends[tp] = None
        if lags.behind(now, ends, consumer._committed_offset):
            outages.behind(now)
        else:
            outages.caught_up(now)

    @app.timer(interval=1.0)
    async def check_run_watches():
        if app.rebalancing:
            return  # ownership is moving: each run's next owner ticks it
        runs = owned(contract.RUN_EVENTS)
        now = time.time()
        note_lag(now)
        for key in watches.keys():
            if is_part(key):
                continue  # a piece of a large watch, recovered from the changelog: read with its run
            raw = watches.get(key)
            partition = raw.partition if isinstance(raw, RunWatch) else (raw or {}).get("partition")
            if partition not in runs:
                continue  # a standby copy, or a run another worker owns now: its owner ticks it
            watch = load_watch(raw, raw.get("run", "") if isinstance(raw, dict) else key.decode(), partition)
            before = tick_mark(watch)
            alerts = watcher.tick(watch, now)
            if alerts:
                state = run_groups(key)
                signals = [RankSignal(alert=alert, world_size=watch.world_size) for alert in alerts]
                await sent(paging.decide(grouper.add_all, state, signals, now))
                keep(key, state)
            if alerts or watch is not raw or tick_mark(watch) != before:
                watches.add([], {key: watch})  # after its alerts are in
            keep(key, run_groups(key), write=False)  # a group recovered mid-wait: its run may send nothing more

    if settings.state_ttl_s:
        @app.timer(interval=min(60.0, settings.state_ttl_s / 4))
        async def expire_silent_state():
            if app.rebalancing:
                return  # ownership is moving: each key's next owner counts its silence
            now, ttl = time.monotonic(), settings.state_ttl_s
            ranks, runs = owned(contract.TELEMETRY), owned(contract.RUN_EVENTS)
            unwritten.expire(now, ttl, lambda key: rank_state.partition_of(key) in ranks)
            for key in watches.expire(now, ttl, lambda key: run_watch.partition_of(key) in runs):
                pager.forget(runs=[key])
                with paging.lock:
                    waiting.discard(key)
                    if key in run_state:  # the run's groups and pages go with its watch
                        del run_state[key]

    @app.on_partitions_revoked.connect
    async def forget_waiting(sender, revoked, **kwargs):
        # Memory only; the new owners find waiting groups again when they tick the runs they got.
        with paging.lock:
            waiting.clear()
        pager.forget(partitions={tp.partition for tp in revoked if tp.topic == contract.URGENT}, everything=True)
