"""Headless Chromium for the HTML report tests: load a file, let its script run, return the DOM and the log.

Debian's ``chromium`` package (``make chromium`` installs it); the tests skip where it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from conftest import missing

#: What Chromium writes to stderr (``--enable-logging=stderr``) when the page's console gets an error.
CONSOLE_ERROR = re.compile(r"CONSOLE.*(Uncaught|Error)|Uncaught ", re.IGNORECASE)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    missing("no chromium here (make chromium, or apt-get install chromium)")


def render(page: Path, *, timeout_s: float = 60.0) -> tuple[str, str]:
    """(the DOM after the page's scripts ran, Chromium's log). No network: the page must not need it."""
    with tempfile.TemporaryDirectory(prefix="rankwatch-chromium-") as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "--no-first-run", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout_s,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if CONSOLE_ERROR.search(line)]
