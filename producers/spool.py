"""The local spool between a rank's publisher and its shipper process.

Append-only segment files in one directory, each named by the spool position (a byte count over
all segments) where it starts, so a position is one integer. One writer (the publisher's sender
thread) appends frames; one reader (the shipper) reads complete frames from a position and never
sees a frame the writer is still writing. The shipper records the position the broker has
acknowledged in ``status.json`` (replaced atomically) and deletes the segments behind it, so a
restarted shipper resumes there: every message is sent at least once, and consumers already drop
replays by their sequence number.

A frame is a header (value, topic and key lengths) followed by the three byte strings.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> w = SpoolWriter(d)
>>> w.append("t", b"k", b"hello"), w.append("t", b"k", b"world")
(15, 30)
>>> [(r.value, r.end) for r in SpoolReader(d).read(0)]
[(b'hello', 15), (b'world', 30)]
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

_HEADER = struct.Struct("<IHH")  # value, topic, key lengths
_SUFFIX = ".seg"
STATUS = "status.json"
WRITER_LOCK = "writer.lock"


class Record(NamedTuple):
    topic: str
    key: bytes
    value: bytes
    end: int  # the spool position just past this record


@dataclass
class Status:
    """What the shipper reports: how far the broker acknowledged, and what it sent or refused."""

    shipped: int = 0  # spool position acknowledged by the broker
    sent: int = 0  # messages acknowledged
    failed: int = 0  # messages the broker refused for good (e.g. too large); skipped
    error: str = ""  # the last delivery error, cleared by the next success


def default_root() -> Path:
    """Where publishers spool unless told otherwise: one folder per user under the temp dir (on a
    shared node another user's folder would not be writable)."""
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"rankwatch-spool-{user}"


def find_spools(root: str | os.PathLike) -> list[Path]:
    """Every spool directory under ``root`` (a folder holding segment files), ``root`` included."""
    return sorted({path.parent for path in Path(root).rglob(f"*{_SUFFIX}")})


def read_status(directory: str | os.PathLike) -> Status:
    try:
        return Status(**json.loads((Path(directory) / STATUS).read_text()))
    except FileNotFoundError:
        return Status()


def write_status(directory: str | os.PathLike, status: Status) -> None:
    path = Path(directory) / STATUS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(status)))
    os.replace(tmp, path)  # a reader sees the old status or the new one, never half of one


def _segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in os.scandir(directory):
        if entry.name.endswith(_SUFFIX):
            found.append((int(entry.name[: -len(_SUFFIX)]), Path(entry.path)))
    return sorted(found)


class SpoolWriter:
    """Appends frames; starts a new segment once one passes ``segment_bytes``."""

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 16 << 20):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        # Held while the writer lives (the kernel lets go if its process dies): `rankwatch ship` leaves
        # a spool alone while a publisher may still write to it.
        self._lock = open(self.directory / WRITER_LOCK, "a")  # noqa: SIM115
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        existing = _segments(self.directory)
        self.position = existing[-1][0] + existing[-1][1].stat().st_size if existing else 0
        self._segment_start = existing[-1][0] if existing else 0
        self._file = open(self._path(self._segment_start), "ab", buffering=0)  # noqa: SIM115

    def _path(self, start: int) -> Path:
        return self.directory / f"{start:020d}{_SUFFIX}"

    def append(self, topic: str, key: bytes, value: bytes) -> int:
        """Write one message; return the spool position past it."""
        name = topic.encode()
        if self.position - self._segment_start >= self.segment_bytes:
            # The reader moves on once the next segment exists, so this one must be complete first.
            self._file.close()
            self._segment_start = self.position
            self._file = open(self._path(self.position), "ab", buffering=0)  # noqa: SIM115
        frame = b"".join((_HEADER.pack(len(value), len(name), len(key)), name, key, value))
        try:
            self._file.write(frame)
        except OSError:
            # A full disk can leave part of a frame, and the reader would take what follows it as the
            # rest: cut it off, so the spool stays a sequence of whole frames.
            self._file.truncate(self.position - self._segment_start)
            raise
        self.position += len(frame)
        return self.position

    def close(self) -> None:
        self._file.close()
        self._lock.close()


def has_writer(directory: str | os.PathLike) -> bool:
    """Whether a live ``SpoolWriter`` holds ``directory``."""
    try:
        with open(Path(directory) / WRITER_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except FileNotFoundError:
        pass
    return False


class SpoolReader:
    """Reads complete frames from a position and deletes the segments behind a position."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def read(self, start: int, max_bytes: int = 1 << 20) -> list[Record]:
        """Complete frames from ``start``: about ``max_bytes`` of them, and at least one if there is one."""
        segments = _segments(self.directory)
        records: list[Record] = []
        for (seg_start, path), (following, _) in zip(segments, [*segments[1:], (None, None)]):
            if following is not None and following <= start:
                continue  # behind start
            position = max(start, seg_start)
            with open(path, "rb") as f:
                f.seek(position - seg_start)
                while position - start < max_bytes:
                    header = f.read(_HEADER.size)
                    if len(header) < _HEADER.size:
                        break
                    n_value, n_topic, n_key = _HEADER.unpack(header)
                    body = f.read(n_topic + n_key + n_value)
                    if len(body) < n_topic + n_key + n_value:
                        break  # the writer is still writing it
                    position += _HEADER.size + len(body)
                    key_end = n_topic + n_key
                    records.append(Record(body[:n_topic].decode(), body[n_topic:key_end], body[key_end:], position))
            # A segment is complete once the next exists: go on only then, and only from its end.
            if following is None or position != following or position - start >= max_bytes:
                break
        return records

    def end(self) -> int:
        """The position past the last byte on disk (frames still being written included)."""
        segments = _segments(self.directory)
        return segments[-1][0] + segments[-1][1].stat().st_size if segments else 0

    def release(self, upto: int) -> None:
        """Delete every segment that ends at or before ``upto`` (the last one stays for the writer)."""
        segments = _segments(self.directory)
        for (_, path), (following, _) in zip(segments, segments[1:]):
            if following <= upto:
                path.unlink(missing_ok=True)
