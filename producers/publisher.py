"""RankPublisher: the one object a training rank talks to.

``log()`` runs on the training thread, so it only appends to a bounded deque (no I/O, no lock, no
tensor sync; about a microsecond). A daemon sender thread wakes every 0.1 s, drains the deque and
turns values into floats without waiting on a device (``rankwatch.producers.values``). It batches many steps
of many metrics into one message once the oldest point has waited ``linger_s`` (0.5 s), or at once
when a value is NaN or infinite, and appends it to a local spool (``rankwatch.producers.spool``). A
metric's non-finite value that follows finite ones also goes ahead of it to ``rankwatch.urgent``
(``UrgentTelemetry``), so that a worker behind on telemetry still pages at once. A shipper
process (``rankwatch.producers.shipper``) sends the spool to Kafka: the Kafka client's CPU, and the GIL it
would hold, stay out of the training process (``bench/step_cost.py``). A broker that is down or
slow costs the training thread nothing: messages wait in the spool (up to ``max_spool_bytes``),
the queue bound holds, and whatever is dropped is counted in ``stats()`` and logged, never silent
and never raised.

Telemetry is written in the contract's binary columnar form (schema 2, ``rankwatch.contract.binary``),
about 40 times cheaper to encode than JSON; ``telemetry_format="json"`` (``RANKWATCH_TELEMETRY_FORMAT=json``)
keeps the JSON form for readers that know only JSON. Workers read both; other events are always JSON.

The sender thread also publishes a heartbeat every ``heartbeat_s``: a telemetry batch whose series
``heartbeat_age_s`` is the time since the last ``log()`` (its step: the last logged step), with the
samplers' readings (RSS, CPU, GPU memory) at the same step. A rank whose training thread hangs
keeps sending heartbeats with a growing age; a rank whose process died sends none. The last batch
of ``close()`` also carries the samplers' readings.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.producers.identity import rank_identity
from rankwatch.producers.outbox import MAX_VALUES, LaneTurns, Outbox, Triple
from rankwatch.producers.shipper import ShipperProcess
from rankwatch.producers.spool import SpoolWriter, default_root
from rankwatch.producers.system import ProcessSampler, Sampler, Samplers
from rankwatch.producers.values import Chunk
from rankwatch.contract import HEARTBEAT, MessageTooLarge, TelemetryBatch, check_size
from rankwatch.settings import DEFAULT_BOOTSTRAP, TELEMETRY_FORMATS, Settings

log = logging.getLogger(__name__)

_STOP = object()
_OPEN: weakref.WeakSet = weakref.WeakSet()
_STOP_GRACE_S = 2.0  # how long close() waits for device values still on their way to the host
_POLL_S = 0.1  # how often the sender reads what was logged: a NaN waits no longer than this to be sent


@atexit.register
def _close_open_publishers() -> None:
    # A script that forgets close() should still deliver its last steps.
    for pub in list(_OPEN):
        pub.close(timeout_s=2.0)


@dataclass(frozen=True)
class PublisherStats:
    logged: int  # log() calls accepted
    dropped: int  # log() / send() calls refused because the queue was full (or values lost at close)
    sent: int  # messages acknowledged by the broker
    failed: int  # messages the broker refused for good (e.g. too large)
    queued: int  # items waiting for the sender
    invalid: int = 0  # logged values that were not numbers, skipped (and logged once per metric)
    heartbeats: int = 0  # heartbeat batches built by the sender thread
    spooled: int = 0  # bytes in the spool not yet acknowledged by the broker


class RankPublisher:
    """Publishes one rank's metrics to ``rankwatch.telemetry``.

    >>> import tempfile
    >>> pub = RankPublisher(run="exp1", rank=0, world_size=1, bootstrap="127.0.0.1:1", drain_s=0,
    ...                     connect_timeout_s=0.5, spool_dir=tempfile.mkdtemp())
    >>> pub.log({"loss": 0.5}, step=0)  # returns at once even with no broker
    >>> pub.close(timeout_s=2)
    >>> pub.stats().spooled > 0  # the broker never answered: the batch waits in the spool
    True
    """

    def __init__(
        self,
        *,
        run: str,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        bootstrap: str = DEFAULT_BOOTSTRAP,
        max_queue: int = 100_000,
        linger_s: float = 0.5,
        max_batch: int = 4096,
        heartbeat_s: float = 5.0,
        samplers: Sequence[Sampler] | None = None,
        connect_timeout_s: float = 5.0,
        producer_config: Mapping[str, Any] | None = None,
        spool_dir: str | os.PathLike | None = None,
        max_spool_bytes: int = 1 << 30,
        drain_s: float = 60.0,
        telemetry_format: str = "binary",
    ):
        default_rank, default_world, default_local = rank_identity(os.environ)
        self.run = run
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        self.local_rank = default_local if local_rank is None else local_rank
        if not run or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need a run name and 0 <= rank < world_size, got {run!r}, {self.rank}, {self.world_size}")
        if max_queue < 1 or max_batch < 1 or linger_s <= 0 or heartbeat_s <= 0:
            raise ValueError("need max_queue >= 1, max_batch >= 1, linger_s > 0 and heartbeat_s > 0")
        if telemetry_format not in TELEMETRY_FORMATS:
            raise ValueError(f"telemetry_format must be one of {TELEMETRY_FORMATS}, got {telemetry_format!r}")
        self.telemetry_format = telemetry_format
        self._binary = telemetry_format == "binary"
        self.bootstrap = bootstrap
        self.max_queue, self.linger_s, self.max_batch, self.heartbeat_s = max_queue, linger_s, max_batch, heartbeat_s
        self.max_spool_bytes = max_spool_bytes
        # A fresh id per incarnation (a restarted rank numbers its messages from 0 again); host and
        # local rank in it say where a silent rank lives.
        incarnation = uuid.uuid4().hex[:8]
        self.producer_id = f"{socket.gethostname()}:{self.local_rank}:{os.getpid()}:{incarnation}"
        root = Path(spool_dir) if spool_dir else default_root()
        self.spool = root / re.sub(r"[^\w.-]", "_", run) / f"rank{self.rank}-{os.getpid()}-{incarnation}"
        self._spool = SpoolWriter(self.spool)
        self._shipped = 0  # the last spool position the shipper reported delivered
        self._shipper = ShipperProcess(self.spool, bootstrap=bootstrap, connect_timeout_s=connect_timeout_s,
                                       producer_config={"client_id": f"rankwatch-{run}-{self.rank}",
                                                        **(producer_config or {})},
                                       drain_s=drain_s)
        self._samplers = Samplers([ProcessSampler()] if samplers is None else samplers)
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._outbox = Outbox(run=run, rank=self.rank, world_size=self.world_size, producer=self.producer_id)
        self._logged = self._dropped = self._failed = self._invalid = self._heartbeats = 0
        self._warned: set[str] = set()
        self._lane = LaneTurns()
        self._started = time.monotonic()
        # The sender notes when it last saw log() activity (to within 0.1 s), which keeps the
        # clock read off the training thread.
        self._last_log: float | None = None
        self._last_step = 0
        self._seen = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-sender-{self.rank}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> RankPublisher:
        """A publisher configured by the environment, for launchers such as torchrun.

        The run id is ``RANKWATCH_RUN``, else torchrun's ``TORCHELASTIC_RUN_ID``; the bootstrap comes
        from ``RANKWATCH_BOOTSTRAP``; rank, world size and local rank from torch.distributed or
        ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; the telemetry format from ``RANKWATCH_TELEMETRY_FORMAT``.
        Keyword arguments win over all of them.
        """
        env = os.environ if env is None else env
        elastic = env.get("TORCHELASTIC_RUN_ID", "")
        run = env.get("RANKWATCH_RUN") or (elastic if elastic != "none" else "")  # torchrun's placeholder
        settings = Settings.from_env(env)
        kwargs: dict[str, Any] = {"run": run, "bootstrap": settings.bootstrap, "spool_dir": settings.spool_dir,
                                  "telemetry_format": settings.telemetry_format}
        kwargs.update(zip(("rank", "world_size", "local_rank"), rank_identity(env)))
        kwargs.update(overrides)
        # SASL/TLS from the settings go to the shipper; a given producer_config adds to them.
        kwargs["producer_config"] = {**settings.security.kafka_python(), **(overrides.get("producer_config") or {})}
        if not kwargs["run"]:
            raise ValueError("no run id: set RANKWATCH_RUN (the same on every rank) or pass run=")
        return cls(**kwargs)

    # -- training thread -------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue ``metrics`` (numbers, one-element tensors or lazy values) for ``step``.

        Never blocks, never raises on I/O, never syncs a device: tensors are read on the sender
        thread. Pass detached tensors (a tensor that needs grad keeps its graph alive until then).
        """
        if len(self._queue) >= self.max_queue:
            self._count_drop()
            return
        self._queue.append((step, dict(metrics)))
        self._logged += 1
        # A NaN or inf is sent at once: wake the sender now rather than at its next poll (up to 0.1 s).
        # Only plain floats are checked here (x != x is NaN; inf - inf is NaN): a tensor would need a sync.
        for value in metrics.values():
            if type(value) is float and (value - value) != 0.0:
                self._wake.set()
                break

    def defer(self, build: Callable[..., tuple[int, Mapping[str, Any]]], *args: Any) -> None:
        """Queue a point that the sender thread works out, in logging order: ``build(*args)`` returns
        ``(step, metrics)``. For a hot path (``TrainerHook``): only ``args`` are taken here."""
        if len(self._queue) >= self.max_queue:
            self._count_drop()
            return
        self._queue.append((build, *args))
        self._logged += 1

    def send(self, event: Any) -> None:
        """Queue any contract event (e.g. an ``EvalShard``) for its topic. Never blocks, never raises on I/O."""
        if len(self._queue) >= self.max_queue:
            self._count_drop()
            return
        self._queue.append(event)

    def _count_drop(self, n: int = 1, why: str = "") -> None:
        before = self._dropped
        self._dropped += n
        if self._dropped.bit_length() > before.bit_length():  # log at 1, 2, 4, 8… drops, not every time
            why = why or f"queue full ({self.max_queue} items)"
            log.warning("rankwatch: %s: %d items dropped so far", why, self._dropped)

    def wake(self) -> None:
        """Have the sender thread read what was logged now, not at its next poll (up to 0.1 s later)."""
        self._wake.set()

    def add_sampler(self, sampler: Sampler) -> None:
        """Read ``sampler()`` (``{metric: float}``) with every heartbeat, on the sender thread."""
        self._samplers.add(sampler)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything logged so far is acknowledged (or failed); True if it finished in time."""
        deadline = time.monotonic() + timeout_s
        marker = threading.Event()  # FIFO: when the sender reaches it, everything before is handed over
        self._queue.append(marker)  # markers may exceed the bound: they are few and tiny
        self._wake.set()
        if not marker.wait(timeout_s):
            return False
        target = self._spool.position
        self._shipper.wake()  # a shipper that died since the last message is replaced now
        while self._shipper.status().shipped < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued within ``timeout_s`` and stop the sender thread.

        The last telemetry batch is marked ``final`` (a rank that stops on purpose is not stalled).
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        self._queue.append(_STOP)  # the sender publishes everything before it, then stops
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():  # else it still writes; the shipper drains what it finds
            self._spool.close()
        self._shipper.close(max(0.0, deadline - time.monotonic()))

    @property
    def shipper_pid(self) -> int:
        """The process that sends this publisher's spool to Kafka (it changes if one had to be replaced)."""
        return self._shipper.pid

    def stats(self) -> PublisherStats:
        status = self._shipper.status()
        return PublisherStats(
            self._logged, self._dropped, status.sent, status.failed + self._failed, len(self._queue), self._invalid,
            self._heartbeats, max(self._spool.position - status.shipped, 0),
        )

    def __enter__(self) -> RankPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sender thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        pending: deque[Chunk] = deque()  # FIFO, so a metric's steps reach the topic in order
        next_beat = self._started + self.heartbeat_s
        stop_at: float | None = None
        poll_s = min(_POLL_S, self.linger_s)
        while True:
            self._wake.wait(max(0.0, min(poll_s, next_beat - time.monotonic())))
            self._wake.clear()
            if self._take(pending) and stop_at is None:
                stop_at = time.monotonic() + _STOP_GRACE_S
            while pending and (pending[0].ready() or (stop_at is not None and time.monotonic() > stop_at)):
                self._publish(pending.popleft())
            if stop_at is not None and not pending:
                return  # no heartbeat after the final batch: it would say the rank is still there
            now = time.monotonic()
            if self._outbox and now - self._outbox.since >= self.linger_s:
                self._send_outbox()
            if now >= next_beat:
                self._heartbeat(now)
                next_beat = now + self.heartbeat_s

    def _take(self, pending: deque[Chunk]) -> bool:
        """Move queued items into chunks of at most ``max_batch`` points; True once close() asked to stop."""
        activity = self._logged + self._dropped
        if activity != self._seen:
            self._seen, self._last_log = activity, time.monotonic()
        stop = False
        while self._queue and not stop:
            points, events, markers, values = [], [], [], 0
            while self._queue and len(points) < self.max_batch and values < MAX_VALUES:
                item = self._queue.popleft()
                if isinstance(item, tuple):
                    if callable(item[0]):  # a deferred point, worked out here
                        try:
                            item = item[0](*item[1:])
                        except Exception:  # the caller's code: its failure costs one point, not the sender
                            log.exception("rankwatch: could not work out a deferred point")
                            self._count_drop()
                            continue
                    points.append(item)
                    values += len(item[1])
                    self._last_step = item[0]
                elif isinstance(item, threading.Event):
                    markers.append(item)
                elif item is _STOP:
                    stop = True
                    break
                else:
                    events.append(item)
            try:
                chunk = Chunk(points, events, markers)
            except Exception:  # the sender must outlive any one bad value
                log.exception("rankwatch: could not read %d logged points", len(points))
                self._count_drop(len(points))
                chunk = Chunk([], events, markers)
            chunk.final = stop  # the chunk that met close()'s stop marker is the last one
            pending.append(chunk)
        return stop

    def _publish(self, chunk: Chunk) -> None:
        try:
            if chunk.ready():
                triples = chunk.resolve()
            else:  # close() gave up waiting on a device
                triples = []
                self._count_drop(len(chunk))
            for name in chunk.invalid:
                self._invalid += 1
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("rankwatch: metric %r has a value that is not a number; skipped", name)
            if triples:
                if len(self._outbox) + len(triples) > MAX_VALUES:
                    self._send_outbox()
                self._outbox.add(triples)
            urgent = any(not math.isfinite(value) for _, _, value in triples)
            if urgent or self._lane:
                turned = self._lane.turned(triples)
                if turned:  # ahead of the telemetry that carries them too
                    self._try_send(self._outbox.urgent(turned))
            if chunk.final:
                # The last word carries the samplers' readings, so a run shorter than one heartbeat
                # still reports its memory; with nothing else left to send, it is a heartbeat.
                if self._outbox:
                    self._try_send(self._outbox.take(self._readings(), final=True))
                else:
                    self._heartbeat(time.monotonic(), final=True)
            elif (urgent or chunk.markers) and self._outbox:
                self._send_outbox()
            for event in chunk.events:
                self._try_send(event)
        finally:
            for marker in chunk.markers:
                marker.set()

    def _send_outbox(self) -> None:
        self._try_send(self._outbox.take())

    def _heartbeat(self, now: float, *, final: bool = False) -> None:
        if self._outbox:  # the heartbeat names the last step: its points must not arrive after it
            self._send_outbox()
        triples = [(self._last_step, HEARTBEAT, now - (self._last_log or self._started)), *self._readings()]
        self._heartbeats += 1
        self._try_send(self._outbox.take(triples, final=final))

    def _readings(self) -> list[Triple]:
        """The samplers' readings, at the last logged step."""
        return [(self._last_step, name, value) for name, value in self._samplers.read()]

    def _try_send(self, event: Any) -> None:
        try:
            self._send(event)
        except MessageTooLarge as exc:  # the caller's to fix: no traceback, and the spool never holds it
            log.error("rankwatch: not sent: %s", exc)
            self._failed += 1
        except Exception:  # the sender must outlive any one bad event
            log.exception("rankwatch: could not publish a %s event", getattr(event, "KIND", "?"))
            self._failed += 1

    def _send(self, event: Any) -> None:
        value = event.to_bytes(binary=True) if self._binary and isinstance(event, TelemetryBatch) else event.to_bytes()
        key = event.key if isinstance(event.key, bytes) else event.key.encode()
        # A broker refuses it for good, and the shipper sends in order: it would block all behind it.
        check_size(len(key) + len(value), f"{event.KIND} message")
        if self._spool.position - self._shipped + len(value) > self.max_spool_bytes:
            self._shipped = self._shipper.status().shipped
            if self._spool.position - self._shipped + len(value) > self.max_spool_bytes:
                self._count_drop(why=f"spool full ({self.max_spool_bytes} bytes the broker has not taken)")
                return
        self._spool.append(event.TOPIC, key, value)
        self._shipper.wake()
