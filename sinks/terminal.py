"""Alerts for people: one line each, coloured by severity when the output is a terminal.

Names and messages come from training code (and from whoever can write to the topic): their
control characters are shown escaped, so a run named ``ESC]0;owned BEL`` cannot retitle,
recolour or rewrite the user's terminal, nor start a second line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from rankwatch.contract import Alert

_COLOURS = {"critical": "\033[1;31m", "warning": "\033[33m", "info": "\033[36m"}
_RESET = "\033[0m"


def printable(value: object) -> str:
    r"""``value`` with what a terminal would act on (ESC, CR, newlines, bidi overrides) escaped.

    >>> print(printable("loss\x1b[2J\nrank\u202e ok"))
    loss\x1b[2J\nrank\u202e ok
    """
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_alert(alert: Alert, *, colour: bool = False) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(alert.ts))
    severity = alert.severity.upper()
    if colour:
        severity = f"{_COLOURS.get(alert.severity, '')}{severity}{_RESET}"
    if alert.rank is not None:
        who = f"rank={alert.rank}"
    elif alert.ranks:
        who = f"ranks={','.join(map(str, alert.ranks))}"
    else:
        who = "run-wide"
    return (
        f"{when} {severity:<8} {alert.status:<8} run={printable(alert.run)} {who} step={alert.step} "
        f"{printable(alert.detector)}/{printable(alert.metric)}: {printable(alert.message)}"
    )


class TerminalSink:
    """Writes each alert as a line (or as its JSON with ``as_json``)."""

    def __init__(self, out: TextIO = sys.stdout, *, as_json: bool = False):
        self.out, self.as_json = out, as_json
        self.colour = not as_json and out.isatty()

    def add(self, alert: Alert) -> None:
        line = json.dumps(alert.to_dict()) if self.as_json else format_alert(alert, colour=self.colour)
        self.out.write(line + "\n")

    def flush(self) -> None:
        self.out.flush()
