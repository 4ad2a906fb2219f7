"""Shared fixtures. Broker tests run against a real embedded Tansu broker and a real Faust worker,
started once per session; each test isolates itself with its own run id. Tests marked ``both_brokers``
run on Apache Kafka too (one KRaft node per session; skipped without Java or Maven, unless
$RANKWATCH_REQUIRE_ALL is set, as CI does)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kafka import KafkaConsumer, TopicPartition

from rankwatch.contract import decode_any
from rankwatch.settings import Settings
from rankwatch.stack import Stack

TEST_RULES = Path(__file__).with_name("rules.toml")

# Tests of code with CUDA paths (fused norms on the device, staged copies, device-timed collectives,
# GPU memory, autocast) take a ``device``: CPU always, CUDA too wherever torch sees a GPU.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

# Publishers spool under the temp dir: keep the suite's spools (and what a test leaves) in one place.
# (Not in a conftest.py at the root: spawned ranks that import this module by name would get that one.)
_TMP = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="rankwatch-tests-")
tempfile.tempdir = None


# A runner that starts the suite as a background job (`make test &`) ignores Ctrl-C, and the
# processes the tests start would inherit that: the tests that press Ctrl-C need it back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _remove_temp_dir():
    yield
    shutil.rmtree(_TMP, ignore_errors=True)


BROKERS = ("tansu", "kafka")


def pytest_configure(config):
    config.addinivalue_line("markers", "both_brokers: run on Apache Kafka as well as on the embedded Tansu broker")


def pytest_generate_tests(metafunc):
    """Every test that needs a broker gets ``broker_kind``: "tansu", and "kafka" too where marked."""
    if "broker_kind" in metafunc.fixturenames:
        kinds = BROKERS if metafunc.definition.get_closest_marker("both_brokers") else BROKERS[:1]
        metafunc.parametrize("broker_kind", kinds, indirect=True, scope="session")


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup): the broker tests spend most
# of their time waiting on brokers, workers and ranks, so two of them share two cores well. Each worker
# runs whole modules, so that a module's fixture (a PostgreSQL server, a 3-broker cluster) starts once;
# everything on Apache Kafka runs on one worker, so that only one JVM at a time starts (the session's
# node stays up beside a module's cluster, idle). Longest first: that lane, then the other broker
# modules, then the quick ones, which fill in the end on whichever worker is free.
KAFKA_LANE = "apache-kafka"
KAFKA_MODULES = {"test_kafka_faults", "test_kafka_security"}


def _lane(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    if item.path.stem in KAFKA_MODULES or (callspec and callspec.params.get("broker_kind") == "kafka"):
        return KAFKA_LANE
    return item.path.stem


@pytest.hookimpl(trylast=True)  # after pytest groups the tests by broker; before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_lane(item)))
    items.sort(key=lambda item: (_lane(item) != KAFKA_LANE, item.get_closest_marker("broker") is None))


def missing(why: str) -> None:
    """A test needs an outside program (Apache Kafka, PostgreSQL, Alertmanager, Chromium) that is not
    here: ``make test`` installs them where it can. Fails where $RANKWATCH_REQUIRE_ALL is set (CI),
    so nothing is skipped there; skips elsewhere."""
    if os.environ.get("RANKWATCH_REQUIRE_ALL"):
        pytest.fail(why)
    pytest.skip(why)


def need_kafka() -> None:
    """Apache Kafka's jars and a JVM, or ``missing``."""
    from rankwatch.errors import BrokerError
    from rankwatch.kafka_broker import java_binary, kafka_classpath

    try:
        java_binary(), kafka_classpath()
    except BrokerError as exc:
        missing(str(exc))


@pytest.fixture(scope="session")
def broker_kind(request) -> str:
    """Which local broker the session's stack runs (one of BROKERS); tests are grouped by it."""
    kind = getattr(request, "param", BROKERS[0])
    if kind == "kafka":
        need_kafka()
    return kind


@pytest.fixture(scope="session")
def stack(tmp_path_factory, broker_kind) -> Stack:
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("rankwatch")), rollup_steps=10, rules=str(TEST_RULES))
    with Stack(settings, embedded=True, port=_free_port(), broker=broker_kind) as running:
        yield running


def _free_port() -> int:
    from rankwatch.broker import free_port

    return free_port()


@pytest.fixture(scope="session")
def bootstrap(stack: Stack) -> str:
    return stack.bootstrap


@pytest.fixture
def run_id(request) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


def consume_json(
    bootstrap: str, topic: str, predicate: Callable[[dict], bool], *, count: int = 1, timeout_s: float = 30.0,
    until: Callable[[list[dict]], bool] | None = None,
) -> list[dict]:
    """Plain kafka-python: read ``topic`` from the beginning until ``count`` JSON objects match
    (or, given ``until``, until it holds for the matches)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50)
    deadline = time.monotonic() + timeout_s
    try:
        # A broker that has just started knows the topic only once its first producer has created it.
        while not (partitions := consumer.partitions_for_topic(topic)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not partitions:
            return []
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        found: list[dict] = []
        def done() -> bool:
            return until(found) if until is not None else len(found) >= count

        while time.monotonic() < deadline and not done():
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    try:  # the contract's reader: binary telemetry (what publishers write) comes back as its JSON form
                        obj = decode_any(record.value)
                    except ValueError:
                        continue  # other tests put malformed bytes on purpose
                    if isinstance(obj, dict) and predicate(obj):
                        found.append(obj)
        return found if until is not None else found[:count]  # one poll may bring more than asked for
    finally:
        consumer.close()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; a zombie (exited, not yet reaped by its new parent) has stopped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@contextlib.contextmanager
def sharing_a_cpu(hogs: int) -> Iterator[None]:
    """This thread and ``hogs`` spinning processes pinned to one CPU: the thread waits, runnable, for it."""
    cpu, allowed = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        for hog in spinning:
            os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # pid 0: this thread only
        time.sleep(0.2)  # the hogs are up and spinning
        yield
    finally:
        os.sched_setaffinity(0, allowed)
        for hog in spinning:
            hog.kill()
            hog.wait()
