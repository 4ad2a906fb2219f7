"""Sinks: where alerts and reports go after the processors. Each sink has ``add(item)`` and ``flush()``."""

from rankwatch.sinks.base import BatchingSink, Sink
from rankwatch.sinks.jsonl import JsonlSink
from rankwatch.sinks.notify import Notifier
from rankwatch.sinks.reader import read_topic
from rankwatch.sinks.terminal import TerminalSink, format_alert
from rankwatch.sinks.webhook import WebhookSink

__all__ = [
    "Sink", "BatchingSink", "TerminalSink", "JsonlSink", "WebhookSink", "Notifier", "format_alert", "read_topic",
]
