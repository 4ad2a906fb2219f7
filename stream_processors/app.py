"""The Faust app: settings in, app out. Flows are registered by ``flows.register``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import faust
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent

from rankwatch.settings import Settings
from rankwatch.stream_processors.clocks import OutageClock

POLL_RECORDS = 500  # records a poll returns, at most
BUFFER_RECORDS = 1000  # a stream's buffer: about a second of stage 1's work at one step a message
FETCH_BYTES = 1024 * 1024  # per partition and fetch


class FlowControl(FlowControlEvent):
    """Faust's flow control, except that resuming flow empties the streams' queues only once per
    consumer generation.

    Faust resumes flow when table recovery ends, within the generation, just after seeking every
    stream partition to its committed offset; resuming empties every queue. The fetch loop may be
    halfway through a batch then, and goes on putting the batch's later records in behind the gap:
    a stream got offsets 361-391 of a partition it had just taken over, then 395-404, and stage 1
    dropped 392-394 as replays when the seek brought them again (the two-worker failover test, run
    20 of a loop beside a busy process: three ranks' windows lost). What a queue holds then was
    fetched from the committed offset on, in order, so keeping it loses nothing; what the seek reads
    again, stage 1 drops as replays. At a new generation the queues are emptied as before, and a
    stream skips any record of an older generation anyway.
    """

    def __init__(self, generation: Callable[[], int], **kwargs: Any):
        super().__init__(**kwargs)
        self._generation, self._cleared_in = generation, None

    def clear(self) -> None:
        self._cleared_in = self._generation()
        super().clear()

    def resume(self) -> None:
        if self._cleared_in != self._generation():
            return super().resume()  # suspends no more, and clears
        self._suspend.clear()
        self._resume.set()


class App(faust.App):
    """Faust's app with two changes. ``before_ack_wait`` runs before Faust waits for every event
    taken to be acknowledged (a rebalance handing partitions over, a stop): a flow that holds acks on
    purpose (``state_writes``) releases them there; Faust would otherwise wait for them for good.
    And its flow control keeps the streams' queues when flow resumes within a generation
    (``FlowControl``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.before_ack_wait: list[Callable[[], None]] = []

    @cached_property
    def flow_control(self) -> FlowControl:
        return FlowControl(lambda: self.consumer_generation_id, loop=self.loop)

    async def _consumer_wait_empty(self, consumer: Any, logger: Any) -> None:
        for release in self.before_ack_wait:
            release()
        await super()._consumer_wait_empty(consumer, logger)


def make_app(settings: Settings, *, flavor: str, partitions: int, outages: OutageClock | None = None) -> App:
    """A Faust app for ``settings``; ``flavor`` is the resolved broker kind ("kafka" or "tansu").

    ``partitions`` must equal the telemetry topic's partition count: Faust co-partitions the state
    table with the stream it is updated from. ``outages`` is the stall clock the worker's broker
    watch stops during outages (a private one if not given).
    """
    from rankwatch.stream_processors import (  # flows import the app's topics; keep make_app importable alone
        eval_flows,
        flows,
        tables,
    )

    extra = {}
    scheme = "rankwatch-kafka"  # an idempotent producer (``kafka_transport``)
    if flavor == "tansu":
        from rankwatch.stream_processors import tansu

        extra, scheme = dict(tansu.APP_SETTINGS), "tansu"
    if settings.session_timeout_s:  # how soon the others take over a killed worker's partitions
        extra.update(broker_session_timeout=settings.session_timeout_s,
                     broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3))
    datadir = Path(settings.data_dir) / "faust"
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = App(
        settings.app_id,
        broker=[f"{scheme}://{server}" for server in settings.bootstrap.split(",")],
        store="memory://",
        datadir=str(datadir),
        topic_partitions=partitions,
        # Changelogs too: on a cluster with min.insync.replicas 2, a 1-replica topic refuses acks=all writes.
        topic_replication_factor=settings.replication_factor,
        # A new monitor reads what ranks published before it started; replays are dropped by seq.
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_linger=0.005,
        # Small polls and buffers keep the telemetry held in the process near a second's worth. The
        # NaN lane does not wait behind it: a consumer of its own reads the lane (``lane.py``), so
        # fetches can be as large as throughput wants (64 KB a partition held two workers at half a
        # core each while 1,024 ranks' lag grew; issue 16, docs/performance.md).
        broker_max_poll_records=POLL_RECORDS,
        stream_buffer_maxsize=BUFFER_RECORDS,
        consumer_max_fetch_size=FETCH_BYTES,
        Table=tables.Table,  # tracks its changelog in the producer's metadata (Apache Kafka needs it)
        **settings.security.faust(),  # SASL/TLS: broker_credentials
        **extra,
    )
    flows.register(app, settings, outages=outages or OutageClock())
    eval_flows.register(app, settings)
    return app
