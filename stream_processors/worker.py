"""Run one Faust worker: resolve the broker kind, make sure topics exist, start the app.

Three things no Faust setting gives, added here:

- **A broker that came back empty** (a restarted embedded broker, which keeps nothing) is noticed
  by a :class:`BrokerWatch`, and the worker starts over in the same process (``exec``): topics are
  re-created with the configured partitions, tables start empty (their changelogs went with the
  broker), and the process id stays, so whatever supervises the worker sees nothing. Starting over
  is simpler and surer than mending a running Faust app's groups, offsets and tables in place.
  While the broker does not answer at all, stall clocks stop (an outage is no rank's stall).
- **A bounded stop.** SIGTERM/SIGINT start Faust's clean stop; if that has not ended within
  ``STOP_DEADLINE_S`` (a broker that is down makes Faust wait about a minute; a crashed agent can
  leave it waiting for good) the process exits anyway. The signals are taken by a thread of our
  own (``sigwait``), so they are heard in every state, even when the event loop no longer runs.
- **No partition left behind.** Records Faust took from the consumer but dropped during a rebalance
  are never read again unless something seeks back; rankwatch's consumer (``consumer``) seeks back
  what it sees dropped, and a :class:`FetchWatch` finds any partition left with records past its
  commit and none in flight, and seeks it back to its committed offset.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time

import faust
from aiokafka.errors import IllegalStateError

from rankwatch import contract
from rankwatch.admin import detect_flavor, drop_mismatched, ensure_topics
from rankwatch.settings import Settings
from rankwatch.stack import PARENT_ENV, READY_LINE
from rankwatch.stream_processors.app import make_app
from rankwatch.stream_processors.brokerwatch import BrokerWatch
from rankwatch.stream_processors.clocks import OutageClock
from rankwatch.stream_processors.fetchwatch import FetchWatch, Offsets, refetch

log = logging.getLogger(__name__)

STOP_DEADLINE_S = 8.0  # SIGTERM to exit, at most (the promise is 10 s)
FETCH_CHECK_S = 2.0  # how often the worker checks for partitions with records no stream was given
ENDS_EVERY_S = 5.0  # how often it asks for their end offsets
_STREAMED = (*contract.TOPICS, *contract.INTERNAL_TOPICS)
NEW_BROKER_LINE = "rankwatch worker: the broker came back empty"  # tests and users look for this
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def build_app(settings: Settings) -> faust.App:
    flavor = settings.broker_flavor if settings.broker_flavor != "auto" else detect_flavor(settings.bootstrap,
                                                                                       security=settings.security)
    counts = ensure_topics(settings.bootstrap, settings.partitions, replication=settings.replication_factor,
                           security=settings.security)
    outages = OutageClock()
    app = make_app(settings, flavor=flavor, partitions=counts[contract.TELEMETRY], outages=outages)
    # Faust creates missing changelogs itself, but one auto-created by a restarted broker from a
    # worker's late writes has the broker's default count, and its table could never recover.
    drop_mismatched(settings.bootstrap, [t.changelog_topic.get_topic_name() for t in app.tables.values()],
                    counts[contract.TELEMETRY], security=settings.security)

    @app.on_rebalance_complete.connect
    async def announce(sender, **kwargs):  # supervisors and tests wait for this line
        assigned = app.consumer.assignment()
        owned = sorted(tp.partition for tp in assigned if tp.topic == contract.TELEMETRY)
        print(f"{READY_LINE}: broker {settings.bootstrap} ({flavor}), telemetry partitions {owned}", flush=True)

    async def start_over(reason: str) -> None:
        print(f"{NEW_BROKER_LINE} ({reason}); starting over", flush=True)
        # At once, before the ranks' shippers fill topics the broker auto-created with its own count.
        await asyncio.to_thread(ensure_topics, settings.bootstrap, settings.partitions,
                                replication=settings.replication_factor, security=settings.security)
        restart_process()

    watch = BrokerWatch(
        settings.bootstrap.split(","), counts, offsets_of=(contract.TELEMETRY,),
        on_away=lambda: outages.away(time.time()), on_back=lambda: outages.back(time.time()), on_new=start_over,
        security=settings.security,
    )

    @app.task
    async def watch_broker():
        await watch.run()

    fetches = FetchWatch()
    ends: dict = {}  # the watched partitions' end offsets, asked every ENDS_EVERY_S
    asked = [float("-inf")]

    @app.timer(interval=FETCH_CHECK_S)
    async def unstick_partitions():
        # A timer that raises stops the whole worker (Faust's crash handling), and this one asks the
        # consumer about partitions a rebalance can take away between two awaits.
        try:
            await check_partitions()
        except IllegalStateError as exc:  # "Partition ... is not assigned": a rebalance began meanwhile
            log.info("partition check skipped: %s", exc)
        except Exception:
            log.exception("partition check failed; the next one runs in %.0f s", FETCH_CHECK_S)

    async def check_partitions() -> None:
        consumer = app.consumer
        if app.rebalancing:
            return
        busy = {message.tp for message in list(consumer._unacked_messages)}
        watched = [tp for tp in consumer.assignment() if tp.topic in _STREAMED and tp not in consumer._paused_partitions]
        # End offsets cost a request (on Tansu, a probe consumer); they only tell of records never fetched.
        if watched and time.monotonic() - asked[0] >= ENDS_EVERY_S:
            asked[0] = time.monotonic()
            try:
                ends.update(await consumer.highwaters(*watched))
            except Exception as exc:  # a broker away: the next time asks again
                log.info("end offsets not known now (%s); checking partitions without them", exc)
        # Each position is a call into the consumer's thread: busy partitions, skipped anyway, are not asked.
        offsets = {tp: Offsets(await consumer.position(tp), consumer._read_offset.get(tp),
                               consumer._committed_offset.get(tp), ends.get(tp))
                   for tp in watched if tp not in busy}
        for tp in fetches.check(busy=busy, offsets=offsets):
            seen = offsets[tp]
            back = seen.committed or 0
            repaired = refetch(consumer, tp)
            log.warning("%s[%d]: holds records to offset %s (fetched to %s) past its commit %s with nothing in "
                        "flight%s; reading it again from %d", tp.topic, tp.partition, seen.end, seen.position,
                        seen.committed, f", {repaired}" if repaired else "", back)
            await consumer.seek(tp, back)

    parent = os.environ.get(PARENT_ENV)
    if parent:
        @app.timer(interval=1.0)
        async def exit_with_parent():  # a supervisor killed outright must not leave its workers running
            if os.getppid() != int(parent):
                os.kill(os.getpid(), signal.SIGTERM)  # Faust's clean stop

    return app


def restart_process() -> None:
    """Replace this process with a fresh run of the same command line (same pid, same stdout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


# A worker holds a few hundred thousand long-lived containers (the rank states: 1,024 ranks x 32
# metrics of detectors, conditions and windows) and allocates a few hundred more per message. At
# Python's default (700, 10, 10) the collections over that heap took 12% of a busy worker's CPU by
# py-spy's count (gc_collect_main) and more by the bench: at 512 ranks x 32 metrics x 60 messages,
# 0.029 -> 0.047 M values per CPU-second with the young generation collected every 50,000
# allocations instead. Cycles are still collected, only in larger batches.
GC_THRESHOLDS = (50_000, 10, 10)

# The NaN lane's reader and the alert sender are threads beside a loop that is busy with telemetry.
# Each of their socket calls gives the GIL up and waits for it again, up to the switch interval
# (5 ms by default) while the loop computes. At 0.5 ms, NaN-to-alert at 1,024 ranks was about
# 10 ms faster at p50 in every run compared, and the worker's throughput stayed within its spread,
# perhaps 4% lower (docs/performance.md).
SWITCH_INTERVAL_S = 0.0005


def run_worker(settings: Settings, *, loglevel: str = "warning") -> None:
    """Block until SIGINT/SIGTERM; Faust's worker stops the app cleanly on either, within the deadline."""
    # Blocked before any thread starts, so every thread inherits it and only ``_stop_on_signal`` hears them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # kafka-python serves the NaN lane's own reader (which Faust's agent backs up) and the admin calls
    # at start (whose failures raise): its reconnect lines, several a second while the broker is
    # away, would drown the broker watch's one.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    app = build_app(settings)
    worker = _Worker(app, loglevel=loglevel, quiet=True)
    threading.Thread(target=_stop_on_signal, args=(worker,), daemon=True, name="stop-on-signal").start()
    worker.execute_from_commandline()


class _Worker(faust.Worker):
    _deadline: threading.Timer | None = None

    def _setup_spinner_handler(self, logger: logging.Logger, level: int) -> None:
        # Faust's start-up spinner turns on every logger at DEBUG to spin once per record: every
        # aiokafka fetch and send then built a log record nobody shows (6% of a busy worker's time).
        self.spinner = None

    def _schedule_shutdown(self, sig: signal.Signals) -> None:
        # Every stop by signal comes here (also one that reached Faust's own handler): arm the deadline.
        if self._deadline is None:
            self._deadline = threading.Timer(STOP_DEADLINE_S, _exit_now, args=(sig,))
            self._deadline.daemon = True
            self._deadline.start()
        super()._schedule_shutdown(sig)


def _stop_on_signal(worker: _Worker) -> None:
    sig = signal.Signals(signal.sigwait(_STOP_SIGNALS))
    try:
        worker.loop.call_soon_threadsafe(worker._schedule_shutdown, sig)  # what Faust's handler does
    except RuntimeError:  # the loop is closed: only the deadline is left
        threading.Timer(STOP_DEADLINE_S, _exit_now, args=(sig,)).start()
    signal.sigwait(_STOP_SIGNALS)  # a second signal (Ctrl-C twice) means now
    _exit_now(sig)


def _exit_now(sig: signal.Signals) -> None:
    print(f"rankwatch worker: not stopped cleanly after {sig.name}; exiting now", file=sys.stderr, flush=True)
    os._exit(1)
