"""Sinks: where alerts and reports go after the processors. Each sink has ``add(item)`` and ``flush()``."""

from sinks.base import BatchingSink, Sink
from sinks.jsonl import JsonlSink
from sinks.notify import Notifier
from sinks.reader import read_topic
from sinks.terminal import TerminalSink, format_alert
from sinks.webhook import WebhookSink

__all__ = [
    "Sink", "BatchingSink", "TerminalSink", "JsonlSink", "WebhookSink", "Notifier", "format_alert", "read_topic",
]
