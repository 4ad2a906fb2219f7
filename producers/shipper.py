"""The shipper: a process beside each training process that sends its spool to Kafka.

A Kafka client costs CPU for every message, and inside the training process that CPU comes with
the GIL the training thread needs (``bench/step_cost.py`` measured it). So the publisher only
appends encoded messages to a local spool (``rankwatch.producers.spool``) and this process, started by the
publisher, does the rest: it sends in order, waits for the broker's acknowledgement, records how
far it got, and retries for as long as the broker is away. Nothing is lost while the disk lasts.

In order means on the broker too. Workers drop a message whose ``seq`` is at or below one already
applied (a replay), so a later message that lands before an earlier one silences the earlier one for
good. A client sending several batches of one partition can let that happen: the first fails after
its retries while the broker is away, the next goes out once it is back (seen on a 3-broker cluster
stopped for a minute: a rank's first 200 steps were lost so). So each flush holds at most one batch
per partition, which the broker writes whole or not at all, and the next waits for it.

The publisher holds a pipe to the shipper's stdin: a byte ``w`` means "new data", ``c`` means
"closing: ship what is there, then exit". End of file, or a new parent process (the publisher's
process died, and with it any ``c``), means the same. After that the shipper keeps trying for
``--drain-s`` seconds; what it could not deliver stays in the spool for ``rankwatch ship DIR``.
Ctrl-C in the training terminal reaches the shipper too, and it ignores it: the training
process's last steps are the ones a user wants to see.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rankwatch.producers.spool import Record, SpoolReader, Status, read_status, write_status

log = logging.getLogger("rankwatch.shipper")

_WAKE, _CLOSE = b"w", b"c"
_LOCK = "lock"
CONFIG_ENV = "RANKWATCH_PRODUCER_CONFIG"
_IDLE_S = 1.0  # with no wake-up: how often the shipper looks for data and for its parent
_MAX_BACKOFF_S = 5.0
_ROUND_BYTES = 4 << 20  # read from the spool at once
_FLUSH_BYTES = 256 << 10  # sent, then awaited; one batch per partition (see ``_BATCH_BYTES``)
_BATCH_BYTES = 2 * _FLUSH_BYTES
_REMIND_S = 30.0  # a failure that lasts is said again after 30 s, then 60 s, 120 s… (at most hourly)


def kafka_config(bootstrap: str, connect_timeout_s: float, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """kafka-python producer settings: ours, then the user's ``producer_config`` on top."""
    config = {
        "bootstrap_servers": bootstrap,
        "client_id": "rankwatch-shipper",
        # Kafka's own default since 3.0: a message counts as sent once min.insync.replicas hold it, so
        # losing the partition leader loses nothing the spool already let go of. Training never waits on it.
        "acks": "all",
        # A flush's messages wait for the flush, so they make one batch per partition (module doc).
        "linger_ms": 60_000,
        "batch_size": _BATCH_BYTES,
        # kafka-python's metrics only cost CPU.
        "metrics_enabled": False,
        "max_block_ms": int(connect_timeout_s * 1000),
        "bootstrap_timeout_ms": int(connect_timeout_s * 1000),
        "request_timeout_ms": 10_000,
        "retries": 5,
        # One request in flight, so a retry cannot reorder messages: processors drop a seq lower
        # than one already applied as a replay.
        "max_in_flight_requests_per_connection": 1,
    }
    return {**config, **overrides}


class Shipper:
    """Ships one spool directory; :meth:`run` returns when it is empty and closing, or the drain ends."""

    def __init__(self, directory: str | os.PathLike, config: Mapping[str, Any], *, drain_s: float = 60.0,
                 wake_fd: int | None = None):
        self.directory = Path(directory)
        self.config, self.drain_s, self.wake_fd = dict(config), drain_s, wake_fd
        self.reader = SpoolReader(self.directory)
        self.status = read_status(self.directory)
        self.parent = os.getppid()
        self.closing_at: float | None = None if wake_fd is not None else time.monotonic()
        self._producer = None
        self._reached = False  # whether the user was told that the broker took a message
        self._remind_at, self._remind_s = 0.0, _REMIND_S
        self._selector = selectors.DefaultSelector()
        if wake_fd is not None:
            self._selector.register(wake_fd, selectors.EVENT_READ)

    def run(self) -> bool:
        """Ship until done; True if everything written was delivered (the spool is then removed).

        False at once if another shipper holds the spool: two would send everything twice.
        """
        with contextlib.suppress(FileNotFoundError), open(self.directory / _LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel lets go when a shipper dies
            except BlockingIOError:
                log.warning("rankwatch shipper: another shipper is sending %s", self.directory)
                return False
            return self._run()
        return False  # the spool is gone

    def _run(self) -> bool:
        backoff = 0.0
        try:
            while self.directory.is_dir():  # else removed from under us (a temp-dir cleaner): nothing to do
                records = self.reader.read(self.status.shipped, _ROUND_BYTES)
                if records and self._ship(records):
                    backoff = 0.0
                    continue
                if self.closing_at is not None:
                    if not records:
                        return self._finish()
                    if time.monotonic() - self.closing_at >= self.drain_s:
                        return self._finish()
                if records:  # the broker is away: back off, but still hear a close
                    backoff = min(max(2 * backoff, 0.25), _MAX_BACKOFF_S)
                self._wait(backoff or _IDLE_S)
            return False
        except FileNotFoundError:
            if self.directory.is_dir():
                raise
            return False
        finally:
            if self._producer is not None:
                _discard(self._producer, timeout_s=1.0)

    def _wait(self, timeout_s: float) -> None:
        if self.wake_fd is None:
            time.sleep(timeout_s)
            return
        if self._selector.select(timeout_s):
            data = os.read(self.wake_fd, 4096)
            if not data or _CLOSE in data:
                self.close()
        if os.getppid() != self.parent:
            self.close()  # the publisher's process died without closing

    def close(self) -> None:
        """Ship what is there, then stop (SIGTERM and the publisher's ``c`` come here)."""
        if self.closing_at is None:
            self.closing_at = time.monotonic()
            self._selector.unregister(self.wake_fd)
            self.wake_fd = None

    def _ship(self, records: Sequence[Record]) -> bool:
        """Send a round, one flush after another; True if the position moved past every record in it."""
        for flush in _flushes(records):
            if not self._flush(flush):
                return False
        self.reader.release(self.status.shipped)
        if not self._reached:  # one line that says publishing works (stderr is the training process's)
            self._reached = True
            log.info("rankwatch shipper: the broker at %s took the first messages of %s",
                     self.config["bootstrap_servers"], self.directory.name)
        return True

    def _flush(self, records: Sequence[Record]) -> bool:
        """Send ``records`` and wait for them; True if the position moved past every one."""
        from kafka.errors import KafkaError

        producer = self._connect()
        if producer is None:
            return False
        try:
            futures = [producer.send(r.topic, r.value, key=r.key) for r in records]
            producer.flush(timeout=self.config["request_timeout_ms"] / 1000 + 1)
        except KafkaError as exc:
            return self._failed(exc)
        sent = failed = 0
        for record, future in zip(records, futures):
            if future.succeeded():
                sent += 1
            elif future.is_done and not future.retriable():
                failed += 1  # refused for good: retrying cannot help, and it must not block the rest
                log.error("rankwatch shipper: the broker refused a %d-byte message to %s: %s",
                          len(record.value), record.topic, future.exception)
            else:
                return self._failed(future.exception)  # resent from the last position shipped
        self.status.shipped = records[-1].end
        self.status.sent += sent
        self.status.failed += failed
        self.status.error = ""
        write_status(self.directory, self.status)
        return True

    def _failed(self, exc: BaseException | None) -> bool:
        # A fresh client for the retry: the old one would send its buffered copies as well.
        producer, self._producer = self._producer, None
        _discard(producer)
        self._report(exc)
        return False

    def _report(self, exc: BaseException | None) -> None:
        # Each new failure at once; one that lasts again after a growing gap, so a wrong bootstrap
        # is neither silent nor a line every retry.
        now, changed = time.monotonic(), self.status.error != str(exc)
        if changed or now >= self._remind_at:
            self._remind_s = _REMIND_S if changed else min(2 * self._remind_s, 3600.0)
            self._remind_at = now + self._remind_s
            log.warning("rankwatch shipper: delivery to %s failed (%s); retrying",
                        self.config["bootstrap_servers"], exc)
        if changed:
            self.status.error = str(exc)
            write_status(self.directory, self.status)

    def _connect(self):
        if self._producer is None:
            from kafka import KafkaProducer
            from kafka.errors import KafkaError

            try:
                self._producer = KafkaProducer(**self.config)
            except KafkaError as exc:
                self._report(exc)
        return self._producer

    def _finish(self) -> bool:
        left = self.reader.end() - self.status.shipped
        if left > 0:
            log.warning("rankwatch shipper: %d bytes not delivered to %s; they stay in %s "
                        "(`rankwatch ship %s` sends them)", left, self.config["bootstrap_servers"],
                        self.directory, self.directory)
            return False
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.directory.parent.rmdir()  # the run's folder, once its last rank's spool is gone
        return True


def _flushes(records: Sequence[Record]) -> list[Sequence[Record]]:
    """``records`` cut into runs of at most ``_FLUSH_BYTES``, or single records larger than that, so
    that each run fits one batch per partition."""
    runs, start, size = [], 0, 0
    for i, record in enumerate(records):
        if i > start and size + len(record.value) > _FLUSH_BYTES:
            runs.append(records[start:i])
            start, size = i, 0
        size += len(record.value)
    if start < len(records):
        runs.append(records[start:])
    return runs


def _discard(producer, timeout_s: float = 0.0) -> None:
    """Close a kafka-python producer without waiting past ``timeout_s`` for requests the broker never answered.

    Its ``close`` flushes first and, when that times out, raises and leaves the client running (a
    traceback on the training process's stderr, a leaked thread, buffered copies sent later). Then
    its sender is stopped without sending (kafka-python 3.0 has no public abort; pinned) and the
    close finishes, now with nothing left to flush.
    """
    from kafka.errors import KafkaTimeoutError

    try:
        producer.close(timeout=timeout_s)
    except KafkaTimeoutError:
        producer._sender.force_close()  # fails what it still holds
        producer._sender.join(1.0)
        producer.close(timeout=0)


class ShipperProcess:
    """The publisher's handle on its shipper process."""

    def __init__(self, directory: str | os.PathLike, *, bootstrap: str, connect_timeout_s: float = 5.0,
                 producer_config: Mapping[str, Any] | None = None, drain_s: float = 60.0):
        self.directory = Path(directory)
        self._args = [
            # Not ``-m rankwatch.producers.shipper``: the package imports this module before runpy would run it.
            sys.executable, "-c", "import sys; from rankwatch.producers.shipper import main; sys.exit(main())",
            str(self.directory), "--bootstrap", bootstrap,
            "--connect-timeout-s", str(connect_timeout_s), "--drain-s", str(drain_s),
        ]
        # In the environment, not the command line: producer settings may hold SASL passwords, and
        # any user can read a process's command line.
        self._config = json.dumps(dict(producer_config or {}))
        self.final: Status | None = None
        self.restarts = 0
        self._closed = False
        self._lock = threading.Lock()  # the sender thread and flush() may both find it dead
        self._proc = self._start()

    def _start(self) -> subprocess.Popen:
        # The child must find this package even when it is not installed (a source checkout).
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               CONFIG_ENV: self._config}
        proc = subprocess.Popen(self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        os.set_blocking(proc.stdin.fileno(), False)  # a wake-up never blocks the sender thread
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _ensure_running(self) -> None:
        with self._lock:
            if self._proc.poll() is None:
                return
            # It died (killed, or out of memory): a new one resumes from the last position shipped.
            log.warning("rankwatch: the shipper exited with %s; starting another", self._proc.returncode)
            self._proc.stdin.close()
            self._proc.stdout.close()
            self.restarts += 1
            self._proc = self._start()

    def wake(self) -> None:
        """New data is in the spool (a no-op once closing)."""
        if self._closed:
            return
        self._ensure_running()
        try:
            self._proc.stdin.write(_WAKE)
        except (BlockingIOError, BrokenPipeError):
            pass  # the pipe is full (a wake-up is waiting already), or it died this instant

    def status(self) -> Status:
        return self.final or read_status(self.directory)

    def close(self, timeout_s: float) -> bool:
        """Tell the shipper to finish and wait up to ``timeout_s``; True if everything was delivered.

        On time-out the shipper goes on in the background for its drain time.
        """
        if not self._closed:
            self._closed = True
            self._ensure_running()  # a dead shipper would leave the spool behind
            try:
                self._proc.stdin.write(_CLOSE)
            except (BlockingIOError, BrokenPipeError):
                pass  # end of file says the same
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        out = self._proc.stdout.read()
        self._proc.stdout.close()
        if out:
            self.final = Status(**json.loads(out))
        return self._proc.returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rankwatch-shipper",
        description="Send a rankwatch spool directory to Kafka; started by the publisher, or by `rankwatch ship`.",
    )
    parser.add_argument("directory", help="the spool directory")
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port[,host:port]")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0)
    parser.add_argument("--drain-s", type=float, default=60.0,
                        help="after the publisher closes, keep trying this long (default 60)")
    parser.add_argument("--producer-config", default=os.environ.get(CONFIG_ENV, "{}"),
                        help=f"kafka-python producer settings, as JSON (default: ${CONFIG_ENV}, which the "
                             "publisher sets; secrets belong there, not on a command line)")
    parser.add_argument("--wake-stdin", action=argparse.BooleanOptionalAction, default=None,
                        help="stdin is the publisher's pipe: wait for its close (the default when stdin is a pipe); "
                             "without, ship what is there and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # one line per change of error, from us, is enough
    wake = args.wake_stdin if args.wake_stdin is not None else _is_pipe(0)
    if wake:  # started by a publisher: Ctrl-C is for the training process, and we deliver its last steps
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = kafka_config(args.bootstrap, args.connect_timeout_s, json.loads(args.producer_config))
    shipper = Shipper(args.directory, config, drain_s=args.drain_s, wake_fd=0 if wake else None)
    signal.signal(signal.SIGTERM, lambda *_: shipper.close())
    done = shipper.run()
    try:
        print(json.dumps(asdict(shipper.status)), flush=True)  # the publisher reads its final counts here
    except BrokenPipeError:  # the publisher's process is gone: no one to tell
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at interpreter exit
    return 0 if done else 3


def _is_pipe(fd: int) -> bool:
    import stat

    return stat.S_ISFIFO(os.fstat(fd).st_mode)


if __name__ == "__main__":
    sys.exit(main())
