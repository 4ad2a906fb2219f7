"""What the ``rankwatch`` subcommands share: their settings, and how a command stops on Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rankwatch.settings import Settings


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings.from_env(bootstrap=getattr(args, "bootstrap", None))


@contextmanager
def until_ctrl_c() -> Iterator[Callable[[], bool]]:
    """Ctrl-C sets a flag that the read loops check after each poll, instead of raising
    KeyboardInterrupt wherever the main thread happens to be: inside the Kafka client's own code
    that could leave it unable to close. A second Ctrl-C does raise it (a loop still connecting
    checks no flag), and the block ends quietly either way."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield pressed.is_set  # only the main thread gets signals; an ignored Ctrl-C stays ignored
        return

    def on_ctrl_c(*_) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield pressed.is_set
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)


def like_ctrl_c(signum: int, frame) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # Ctrl-C is ignored here (started as a background job): SIGTERM still stops us
        raise KeyboardInterrupt
