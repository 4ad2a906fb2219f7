"""A throwaway PostgreSQL server for tests: ``initdb`` and ``pg_ctl`` from Debian's package, in a temp dir.

Debian keeps the server binaries off PATH (``/usr/lib/postgresql/<version>/bin``). PostgreSQL refuses
to run as root, so as root the cluster belongs to the ``postgres`` user (which the package creates)
or ``nobody``. ``make test`` installs the package when apt-get is there and the binaries are not.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def find_bin_dir() -> str | None:
    """The directory holding initdb and pg_ctl, or None when PostgreSQL is not installed."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return str(Path(os.path.realpath(on_path)).parent)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return str(Path(found[-1]).parent) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``with PostgresServer() as pg: pg.url`` — a new cluster on a free port, trust auth, removed after."""

    def __init__(self, bin_dir: str):
        self.bin_dir, self.port = bin_dir, _free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres" if _user_exists("postgres") else "nobody"
        # As root, the suite's temp dir is root's alone (0700): the server's user could not enter it.
        self.root = Path(tempfile.mkdtemp(prefix="rankwatch-pg-", dir="/tmp" if self.user else None))
        self.data = self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{self.user or pwd.getpwuid(os.geteuid()).pw_name}@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = [f"{self.bin_dir}/{args[0]}", *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, cwd=self.root)

    def __enter__(self) -> PostgresServer:
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.user or pwd.getpwuid(os.geteuid()).pw_name,
                  "--no-sync")
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start")
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
