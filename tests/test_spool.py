"""The spool and its shipper: messages wait on disk until a broker has them, and nothing is lost.

The spool's file logic is tested on its own; delivery runs a real shipper process against a real
embedded broker (one started late, to be away first).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import consume_json, process_alive

from rankwatch.producers import RankPublisher
from rankwatch.producers.spool import Record, SpoolReader, SpoolWriter
from rankwatch import cli, contract
from rankwatch.broker import EmbeddedBroker, free_port


def _read_all(reader: SpoolReader, start: int = 0, max_bytes: int = 100) -> list:
    records = []
    while batch := reader.read(start, max_bytes):
        records += batch
        start = batch[-1].end
    return records


def test_frames_round_trip_across_segments_in_reads_of_any_size(tmp_path):
    writer = SpoolWriter(tmp_path, segment_bytes=64)
    sent = [(f"topic{i % 3}", f"k{i}".encode(), os.urandom(i * 7 % 90)) for i in range(60)]
    ends = [writer.append(*message) for message in sent]
    assert len(list(tmp_path.glob("*.seg"))) > 10
    for max_bytes in (1, 100, 1 << 20):
        records = _read_all(SpoolReader(tmp_path), max_bytes=max_bytes)
        assert [(r.topic, r.key, r.value) for r in records] == sent
        assert [r.end for r in records] == ends
    middle = ends[29]
    assert [r.value for r in _read_all(SpoolReader(tmp_path), middle)] == [v for *_, v in sent[30:]]


def test_a_round_is_sent_in_flushes_that_each_fit_one_batch_per_partition():
    """Why: the broker writes a batch whole or not at all, and the next flush waits for this one, so
    no later message of a partition can land before an earlier one (workers drop it as a replay)."""
    from rankwatch.producers.shipper import _BATCH_BYTES, _FLUSH_BYTES, _flushes

    sizes = [100, 5_000, 90_000, 200_000, 1_000_000, 3, 300_000, 70_000, 70_000, 70_000, 70_000, 1]
    records = [Record("t", b"k", bytes(n), end) for end, n in enumerate(sizes)]
    flushes = _flushes(records)
    assert [r for flush in flushes for r in flush] == records  # every record once, in order
    for flush in flushes:
        assert len(flush) == 1 or sum(len(r.value) for r in flush) <= _FLUSH_BYTES < _BATCH_BYTES
    assert len(flushes) < len(records)  # small records share a flush
    assert _flushes([]) == []


def test_release_deletes_only_segments_behind_the_position(tmp_path):
    writer = SpoolWriter(tmp_path, segment_bytes=64)
    ends = [writer.append("t", b"k", bytes(40)) for _ in range(10)]
    reader = SpoolReader(tmp_path)
    reader.release(ends[4])
    assert [r.end for r in _read_all(reader, ends[4])] == ends[5:]  # what was not shipped is still there
    reader.release(ends[-1])
    assert len(list(tmp_path.glob("*.seg"))) == 1  # the writer's segment stays
    writer.close()
    assert SpoolWriter(tmp_path).position == ends[-1] == reader.end()  # a new writer continues at the end


def test_a_frame_still_being_written_is_not_read(tmp_path):
    writer = SpoolWriter(tmp_path)
    first = writer.append("t", b"k", b"whole")
    frame = Path(tmp_path / "frame")
    SpoolWriter(frame).append("t", b"k", b"x" * 100)
    data = next(frame.glob("*.seg")).read_bytes()
    segment = next(tmp_path.glob("*.seg"))
    with open(segment, "ab") as f:
        f.write(data[:50])  # half a frame: the writer is in the middle of it
    assert [r.value for r in SpoolReader(tmp_path).read(0)] == [b"whole"]
    with open(segment, "ab") as f:
        f.write(data[50:])
    assert [r.value for r in SpoolReader(tmp_path).read(first)] == [b"x" * 100]


def test_a_failed_write_leaves_no_half_frame(tmp_path):
    writer = SpoolWriter(tmp_path)
    writer.append("t", b"k", b"before")
    real = writer._file

    class DiskFull:
        def write(self, data):
            real.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def truncate(self, size):
            return real.truncate(size)

    writer._file = DiskFull()
    with pytest.raises(OSError):
        writer.append("t", b"k", b"x" * 100)
    writer._file = real
    writer.append("t", b"k", b"after")  # the disk has room again
    assert [r.value for r in SpoolReader(tmp_path).read(0)] == [b"before", b"after"]


def _steps(bootstrap: str, run: str, n: int) -> list[int]:
    """The steps of ``loss`` on the topic once ``n`` have arrived (more means duplicates)."""

    def steps(batches: list[dict]) -> list[int]:
        return sorted(step for b in batches for step in b["series"]["loss"]["steps"])

    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run and "loss" in b["series"],
                           until=lambda found: len(steps(found)) >= n, timeout_s=30)
    return steps(batches)


@pytest.mark.broker
def test_a_broker_that_comes_up_late_gets_everything_without_help(run_id, tmp_path):
    port = free_port()
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=f"127.0.0.1:{port}", samplers=[],
                              connect_timeout_s=0.5, spool_dir=tmp_path, linger_s=0.1)
    for step in range(50):
        publisher.log({"loss": float(step)}, step)
        time.sleep(0.01)
    time.sleep(1.0)
    assert publisher.stats().sent == 0 and publisher.stats().spooled > 0  # no broker yet: all of it waits
    with EmbeddedBroker(port=port).start() as broker:
        assert publisher.flush(timeout_s=30), publisher.stats()
        publisher.close()
        stats = publisher.stats()
        assert (stats.spooled, stats.failed, stats.dropped) == (0, 0, 0)
        assert set(_steps(broker.bootstrap, run_id, 50)) == set(range(50))
    assert not publisher.spool.exists()  # delivered, so the spool is gone


@pytest.mark.broker
def test_rankwatch_ship_delivers_what_shippers_gave_up_on_and_leaves_live_spools_alone(
        bootstrap, run_id, tmp_path, monkeypatch):
    def offline(rank: int) -> RankPublisher:
        return RankPublisher(run=run_id, rank=rank, world_size=2, bootstrap=f"127.0.0.1:{free_port()}", samplers=[],
                             connect_timeout_s=0.2, spool_dir=tmp_path, drain_s=0, linger_s=0.1)

    left, live = offline(0), offline(1)
    for step in range(20):
        left.log({"loss": float(step)}, step)
        live.log({"loss": float(step)}, step)
    left.close(timeout_s=5)
    assert left.stats().spooled > 0 and left.spool.exists()  # left for later, with a warning
    assert live.flush(timeout_s=1) is False and live.stats().spooled > 0

    monkeypatch.setenv("RANKWATCH_SPOOL_DIR", str(tmp_path))
    assert cli.main(["ship", "--bootstrap", bootstrap]) == 1  # one spool is still being written
    assert _steps(bootstrap, run_id, 20) == list(range(20))  # rank 0's, once; rank 1's are not touched
    assert not left.spool.exists() and live.spool.exists()
    assert cli.main(["ship", str(left.spool), "--bootstrap", bootstrap]) == 1  # nothing there any more
    live.close(timeout_s=1)


@pytest.mark.broker
def test_a_killed_shipper_is_replaced_and_nothing_is_lost(bootstrap, run_id, tmp_path):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[],
                              spool_dir=tmp_path, linger_s=0.1)
    for step in range(10):
        publisher.log({"loss": float(step)}, step)
    assert publisher.flush()
    publisher._shipper._proc.kill()
    publisher._shipper._proc.wait()
    for step in range(10, 20):
        publisher.log({"loss": float(step)}, step)
    assert publisher.flush(timeout_s=30)
    publisher.close()
    assert publisher._shipper.restarts == 1
    assert set(_steps(bootstrap, run_id, 20)) == set(range(20))


_DYING_RANK = """
import os, signal, sys, time
from rankwatch.producers import RankPublisher
publisher = RankPublisher(run=sys.argv[1], rank=0, world_size=1, bootstrap=sys.argv[2], samplers=[], linger_s=0.1,
                          connect_timeout_s=0.5)
for step in range(30):
    publisher.log({"loss": float(step)}, step)
time.sleep(2.0)  # the last batch reaches the spool, with room for a loaded CI machine
print(publisher.shipper_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the process is gone
"""


@pytest.mark.broker
def test_a_killed_training_process_still_delivers_its_spooled_steps(run_id, tmp_path):
    # The broker is away while the rank runs and dies, so nothing can have been delivered before.
    port = free_port()
    with open(tmp_path / "stderr", "w") as err:  # a file, not a pipe: the orphaned shipper keeps it open
        child = subprocess.run([sys.executable, "-c", _DYING_RANK, run_id, f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                               stderr=err, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert child.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    shipper = int(child.stdout.split()[0])
    assert process_alive(shipper)  # orphaned, and still trying (for drain_s)
    with EmbeddedBroker(port=port).start() as broker:
        assert _steps(broker.bootstrap, run_id, 30) == list(range(30))
        deadline = time.monotonic() + 10
        while process_alive(shipper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(shipper)  # it delivered, and left

