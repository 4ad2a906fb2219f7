"""Bring up and tear down a local rankwatch: the embedded broker (optional), Faust workers, the report
store's sink and (given a port) the report API.

Workers run as child processes (``python -m rankwatch worker``) in their own sessions, so Ctrl-C
reaches only us and we stop things in order: workers first (they commit and leave), broker last.
A worker whose Stack process dies without stopping it (SIGKILL, a crash) stops itself within a second;
so does the embedded broker (see ``rankwatch.broker``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rankwatch.admin import ensure_topics
from rankwatch.broker import EmbeddedBroker
from rankwatch.kafka_broker import KafkaBroker
from rankwatch.errors import RankwatchError
from rankwatch.settings import Settings

READY_LINE = "rankwatch worker ready"  # printed by rankwatch.stream_processors.worker; kept in sync by a test
STORE_READY_LINE = "rankwatch store ready"  # printed by `rankwatch store` (rankwatch.cli_store.READY_LINE)
PARENT_ENV = "RANKWATCH_PARENT_PID"  # a worker started by a Stack stops when this process is gone


class WorkerProcess:
    def __init__(self, settings: Settings, index: int, *, echo: Callable[[str], None] | None, env: dict[str, str]):
        self.index = index
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=200)
        self._echo = echo
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "worker", "--bootstrap", settings.bootstrap],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True, name=f"worker-{index}-output").start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.tail.append(line)
            if READY_LINE in line:
                self.ready.set()
            if self._echo:
                self._echo(f"[worker-{self.index}] {line}")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class StoreProcess:
    """``rankwatch store`` as a child process: the report store follows the topics beside the workers."""

    def __init__(self, settings: Settings, *, env: dict[str, str], from_beginning: bool = False):
        log_path = Path(settings.data_dir) / "store.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path, self.started_at = log_path, log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rankwatch", "store", "--bootstrap", settings.bootstrap,
                 *(["--from-beginning"] if from_beginning else [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Until the store process has opened its database (so a query right after start finds it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "rb") as log:
                log.seek(self.started_at)
                output = log.read().decode("utf-8", "replace")
            if STORE_READY_LINE in output:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "was not ready"
                raise RankwatchError(f"the report store {why}; its output ({self.log_path}):\n{output[-2000:]}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # like Ctrl-C: it finishes the batch it is writing
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ApiServer:
    """``rankwatch serve`` in threads of the Stack's own process: the report store, read-only, on loopback.
    The port is taken at once (a taken port fails before anything else starts); ``start`` serves."""

    def __init__(self, settings: Settings, port: int):
        from rankwatch.sinks.api import ReportAPI, make_server
        from rankwatch.sinks.store import store_url

        api = ReportAPI(store_url(settings), rules=settings.rules)
        try:
            self.server = make_server(api, "127.0.0.1", port)
        except OSError as exc:
            raise RankwatchError(f"the report API cannot listen on 127.0.0.1:{port} ({exc.strerror}): is another "
                                 "`rankwatch serve` or `up` running? (`up --serve-port P` picks another, `--no-serve` none)") from None
        self.serving = False

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True,
                         name="report-api").start()
        self.serving = True

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/"

    def stop(self) -> None:
        if self.serving:  # shutdown() waits for serve_forever to return: it would wait forever for one never run
            self.server.shutdown()
        self.server.server_close()


class Stack:
    """``with Stack(settings, embedded=True) as stack:`` gives a running broker and workers.

    ``broker`` picks the local broker that ``embedded`` starts: "tansu" (memory only) or "kafka"
    (Apache Kafka, one KRaft node with its data under the data dir; see ``rankwatch.kafka_broker``).
    ``serve_port`` (0 picks a free one) also serves the report store over HTTP on 127.0.0.1 (``api.url``).
    """

    #: Whether ``start`` also runs the report store's sink; set False on an instance to leave it out.
    with_store: bool = True
    store: StoreProcess | None = None
    api: ApiServer | None = None

    def __init__(
        self,
        settings: Settings,
        *,
        embedded: bool,
        port: int = 9092,
        workers: int = 1,
        echo: Callable[[str], None] | None = None,
        ready_timeout_s: float = 90.0,
        broker: str = "tansu",
        serve_port: int | None = None,
    ):
        if broker not in ("tansu", "kafka"):
            raise ValueError(f"broker must be 'tansu' or 'kafka', got {broker!r}")
        self.settings, self.embedded, self.port, self.broker_kind = settings, embedded, port, broker
        self.n_workers, self.echo, self.ready_timeout_s = workers, echo, ready_timeout_s
        self.serve_port = serve_port
        self.broker: EmbeddedBroker | KafkaBroker | None = None
        self.workers: list[WorkerProcess] = []

    @property
    def bootstrap(self) -> str:
        return self.settings.bootstrap

    def start(self) -> Stack:
        try:
            if self.serve_port is not None:
                self.api = ApiServer(self.settings, self.serve_port)
            if self.embedded:
                log_path = Path(self.settings.data_dir) / "broker.log"
                if self.broker_kind == "kafka":
                    self.broker = KafkaBroker(port=self.port, log_path=log_path, data_dir=self.settings.data_dir)
                else:
                    self.broker = EmbeddedBroker(port=self.port, log_path=log_path)
                self.broker.start()
                self.settings = self.settings.with_(bootstrap=self.broker.bootstrap, broker_flavor=self.broker_kind)
            ensure_topics(self.settings.bootstrap, self.settings.partitions, replication=self.settings.replication_factor,
                          security=self.settings.security)
            self.start_workers()
            self.start_store()
            if self.api is not None:  # after the store: its process has created the database
                self.api.start()
        except BaseException:
            self.stop()
            raise
        return self

    def start_store(self) -> None:
        """The report store's sink (``rankwatch store``); its output goes to ``<data dir>/store.log``."""
        if self.with_store:
            env = dict(os.environ, **self.settings.to_env(), **{PARENT_ENV: str(os.getpid())})
            # A Tansu broker we started holds nothing yet: positions saved from an earlier one mean nothing here.
            fresh = self.embedded and self.broker_kind == "tansu"
            self.store = StoreProcess(self.settings, env=env, from_beginning=fresh)
            self.store.wait_ready(self.ready_timeout_s)

    def start_workers(self) -> None:
        env = dict(os.environ, **self.settings.to_env(), **{PARENT_ENV: str(os.getpid())})
        self.workers = [WorkerProcess(self.settings, i, echo=self.echo, env=env) for i in range(self.n_workers)]
        self.wait_ready()

    def restart_workers(self) -> None:
        """Stop every worker and start fresh ones (the broker, and so the changelogs, stay)."""
        for w in self.workers:
            w.stop()
        self.start_workers()

    def wait_ready(self) -> None:
        for w in self.workers:
            remaining = self.ready_timeout_s
            while not w.ready.wait(0.2):
                remaining -= 0.2
                if w.proc.poll() is not None or remaining <= 0:
                    why = f"exited with code {w.proc.returncode}" if w.proc.poll() is not None else "was not ready in time"
                    raise RankwatchError(f"worker {w.index} {why}; its last output:\n" + "\n".join(w.tail))

    def stop(self) -> None:
        if self.api is not None:
            self.api.stop()
            self.api = None
        for w in self.workers:
            w.stop()
        self.workers = []
        if self.store is not None:  # after the workers: it stores what they sent last, then stops
            self.store.stop()
            self.store = None
        if self.broker:
            self.broker.stop()
            self.broker = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
