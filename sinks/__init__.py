"""Sinks: where alerts and reports go after the processors. Each sink has ``add(item)`` and ``flush()``."""

from sinks.reader import read_topic
from sinks.terminal import TerminalSink, format_alert

__all__ = ["TerminalSink", "format_alert", "read_topic"]
