"""Apache Kafka on this machine: KRaft nodes as JVM child processes, for `rankwatch up --broker kafka` and tests.

The jars come from Maven Central through ``kafka/pom.xml`` (``make kafka``, or the first start when Maven
is installed) into ``kafka/lib``; node settings come from ``kafka/single.properties`` (one node) or
``kafka/cluster.properties`` (three nodes, the fault tests). Unlike the embedded Tansu broker, data is on
disk under the data dir: a node stopped and started again keeps its topics, offsets and messages.

:class:`KafkaBroker` has the interface of :class:`rankwatch.broker.EmbeddedBroker`; :class:`KafkaCluster`
runs several nodes and can kill and restart one of them.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from rankwatch.admin import wait_for_broker
from rankwatch.broker import _die_with_parent, free_port, port_is_free
from rankwatch.errors import BrokerError

KAFKA_DIR = Path(__file__).resolve().parents[1] / "kafka"  # a rankwatch checkout (pip install -e)
SINGLE = "single.properties"
CLUSTER = "cluster.properties"
HEAP = "512m"  # a broker idles in ~300 MB; two cores are shared with workers and ranks

# Console output at INFO goes to the node's log file: start, shutdown, leader changes.
LOG4J2 = """\
rootLogger.level=INFO
rootLogger.appenderRef.out.ref=out
appender.out.type=Console
appender.out.name=out
appender.out.layout.type=PatternLayout
appender.out.layout.pattern=[%d] %p %m (%c)%n
"""


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Apache Kafka needs Java 17 or newer and `java` is not on PATH: install a JDK "
                          "(e.g. apt-get install openjdk-17-jre-headless)")
    return java


def kafka_classpath(kafka_dir: Path = KAFKA_DIR) -> str:
    """The broker's classpath; fetches the jars with Maven the first time (tens of seconds)."""
    lib = kafka_dir / "lib"
    if not any(lib.glob("kafka_2.13-*.jar")):
        pom = kafka_dir / "pom.xml"
        if not pom.exists():
            raise BrokerError(f"no {pom}: Apache Kafka runs from a rankwatch checkout (its kafka/ folder)")
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(f"Apache Kafka's jars are not in {lib} and Maven (`mvn`) is not on PATH: install "
                              "Maven (e.g. apt-get install maven), then run `make kafka`")
        done = subprocess.run([mvn, "-q", "-f", str(pom), "dependency:copy-dependencies"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            raise BrokerError(f"fetching Apache Kafka with Maven failed: {last[0]}")
    return f"{lib}/*"


def read_properties(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def new_cluster_id() -> str:
    """Kafka's cluster id form: 16 random bytes, URL-safe base64 without padding, not starting with '-'."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class KafkaNode:
    """One combined broker + controller KRaft node; its files live under ``node_dir``."""

    def __init__(self, *, node_id: int, host: str, port: int, controller_port: int, voters: str,
                 node_dir: Path, config: Mapping[str, str], log_path: Path | None = None,
                 listeners: Mapping[str, int] | None = None, scram: Sequence[str] = ()):
        self.node_id, self.host, self.port, self.controller_port = node_id, host, port, controller_port
        self.node_dir = Path(node_dir)
        self.log_path = Path(log_path) if log_path else self.node_dir / "server.log"
        # Listeners besides PLAINTEXT (which readiness checks and replication use), each named as its
        # security protocol (SASL_SSL: port): their settings (keystore, SASL) come in ``config``.
        more = {**listeners} if listeners else {}
        self.scram = tuple(scram)  # kafka-storage format --add-scram entries: SCRAM users made at format time
        self.properties = {
            **config,
            "process.roles": "broker,controller",
            "node.id": str(node_id),
            "controller.quorum.voters": voters,
            "listeners": ",".join([f"PLAINTEXT://{host}:{port}", *(f"{n}://{host}:{p}" for n, p in more.items()),
                                   f"CONTROLLER://{host}:{controller_port}"]),
            "advertised.listeners": ",".join([f"PLAINTEXT://{host}:{port}",
                                              *(f"{n}://{host}:{p}" for n, p in more.items())]),
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": ",".join(["PLAINTEXT:PLAINTEXT", *(f"{n}:{n}" for n in more),
                                                        "CONTROLLER:PLAINTEXT"]),
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.node_dir / "data"),
        }
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def formatted(self) -> bool:
        return (self.node_dir / "data" / "meta.properties").exists()

    def _write_files(self) -> tuple[Path, Path]:
        self.node_dir.mkdir(parents=True, exist_ok=True)
        props = self.node_dir / "server.properties"
        props.write_text("".join(f"{k}={v}\n" for k, v in self.properties.items()))
        log4j = self.node_dir / "log4j2.properties"
        log4j.write_text(LOG4J2)
        return props, log4j

    def _java(self, main: str, *args: str, heap: str = HEAP) -> list[str]:
        props, log4j = self._write_files()
        return [java_binary(), f"-Xmx{heap}", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={log4j}", "-cp", kafka_classpath(), main, *args, *([] if args else [str(props)])]

    def format(self, cluster_id: str) -> subprocess.Popen | None:
        """Start formatting the log dir (KRaft needs it once, before the first start); None if done before."""
        if self.formatted:
            return None
        props = self.node_dir / "server.properties"
        scram = [arg for entry in self.scram for arg in ("--add-scram", entry)]
        cmd = self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props), *scram, heap="256m")
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)

    def launch(self) -> None:
        if not port_is_free(self.host, self.port):
            raise BrokerError(f"port {self.port} on {self.host} is taken: is a broker already running there? "
                              f"Use it with --bootstrap {self.bootstrap}, or pick another --port.")
        cmd = self._java("kafka.Kafka")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C goes to us; we stop the broker last, after its clients
                preexec_fn=_die_with_parent(),  # a killed parent does not leave a JVM holding the port
            )

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise BrokerError(f"Apache Kafka node {self.node_id} exited with code {code}: {self._last_error()}")
            try:
                wait_for_broker(self.bootstrap, 1.0)
                return
            except BrokerError:
                if time.monotonic() > deadline:
                    raise BrokerError(f"Apache Kafka node {self.node_id} did not answer on {self.bootstrap} in time "
                                      f"(see {self.log_path})") from None

    def _last_error(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        errors = [line for line in lines if " ERROR " in line or "Exception" in line]
        return (errors or lines or ["empty log"])[-1].strip()[:300] + f" (see {self.log_path})"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The broker's process (benches read its CPU); None when it is not started."""
        return self.proc.pid if self.proc is not None else None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM: a controlled shutdown (leadership moves away first); SIGKILL if it takes too long."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash: no controlled shutdown, nothing flushed."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class KafkaCluster:
    """``n`` combined KRaft nodes on loopback, each with its own ports and data under ``data_dir``."""

    def __init__(self, data_dir: str | Path, *, n: int = 3, host: str = "127.0.0.1", ports: list[int] | None = None,
                 config: str = CLUSTER, log_path: str | Path | None = None, properties: Mapping[str, str] | None = None,
                 listeners: Mapping[str, int] | None = None, scram: Sequence[str] = ()):
        """``properties`` add to (or override) the ``config`` file's; ``listeners`` and ``scram`` go to each node
        (one node only, as they name ports: a SASL/TLS listener and its SCRAM users, for the security tests)."""
        self.data_dir = Path(data_dir)
        ports = ports or [free_port(host) for _ in range(n)]
        controller_ports = [free_port(host) for _ in range(n)]
        voters = ",".join(f"{i + 1}@{host}:{c}" for i, c in enumerate(controller_ports))
        settings = {**read_properties(KAFKA_DIR / config), **(properties or {})}
        self.nodes = [
            KafkaNode(node_id=i + 1, host=host, port=ports[i], controller_port=controller_ports[i], voters=voters,
                      node_dir=self.data_dir / f"node-{i + 1}", config=settings,
                      log_path=log_path if n == 1 and log_path else None, listeners=listeners, scram=scram)
            for i in range(n)
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def start(self, timeout_s: float = 90.0) -> KafkaCluster:
        java_binary(), kafka_classpath()  # say what is missing before anything starts
        cluster_id = new_cluster_id()
        formats = [(node, node.format(cluster_id)) for node in self.nodes]  # in parallel: each is a JVM start
        for node, proc in formats:
            if proc is not None and proc.wait() != 0:
                tail = (proc.stdout.read().strip().splitlines() or ["no output"])[-1]
                raise BrokerError(f"formatting Apache Kafka node {node.node_id} failed: {tail}")
        try:
            for node in self.nodes:
                node.launch()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if node.proc is not None:
                node.wait_ready(deadline)

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def restart(self, index: int, timeout_s: float = 90.0) -> None:
        node = self.nodes[index]
        node.stop()
        node.launch()
        node.wait_ready(time.monotonic() + timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        for node in self.nodes:  # all at once: a node waiting for a quorum that is leaving would hang
            if node.running:
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout_s)

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class KafkaBroker:
    """One Apache Kafka node (``kafka/single.properties``) with its data under ``data_dir``/kafka.

    Start with ``start()`` or as a context manager; ``bootstrap`` is the address to give clients.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9092, log_path: str | Path | None = None,
                 data_dir: str | Path = ".rankwatch", *, properties: Mapping[str, str] | None = None,
                 listeners: Mapping[str, int] | None = None, scram: Sequence[str] = ()):
        """``properties``, ``listeners`` and ``scram``: see :class:`KafkaCluster` (``bootstrap`` stays the PLAINTEXT one)."""
        self.host, self.port = host, port
        self._cluster = KafkaCluster(Path(data_dir) / "kafka", n=1, host=host, ports=[port], config=SINGLE,
                                     log_path=log_path, properties=properties, listeners=listeners, scram=scram)
        self.log_path = self._cluster.nodes[0].log_path

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def _proc(self) -> subprocess.Popen | None:  # as EmbeddedBroker's: `rankwatch broker` watches it
        return self._cluster.nodes[0].proc

    @property
    def pid(self) -> int | None:
        """The broker's process (benches read its CPU); None when it is not started."""
        return self._cluster.nodes[0].pid

    def start(self, timeout_s: float = 90.0) -> KafkaBroker:
        self._cluster.start(timeout_s)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        self._cluster.stop(timeout_s)

    def __enter__(self) -> KafkaBroker:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
