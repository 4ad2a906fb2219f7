"""Run one Faust worker: resolve the broker kind, make sure topics exist, start the app."""

from __future__ import annotations

import os
import signal

import faust

from rankwatch import contract
from rankwatch.admin import detect_flavor, ensure_topics
from rankwatch.settings import Settings
from rankwatch.stack import PARENT_ENV, READY_LINE
from rankwatch.stream_processors.app import make_app


def build_app(settings: Settings) -> faust.App:
    flavor = settings.broker_flavor if settings.broker_flavor != "auto" else detect_flavor(settings.bootstrap)
    counts = ensure_topics(settings.bootstrap, settings.partitions)
    app = make_app(settings, flavor=flavor, partitions=counts[contract.TELEMETRY])

    @app.on_rebalance_complete.connect
    async def announce(sender, **kwargs):  # supervisors and tests wait for this line
        assigned = app.consumer.assignment()
        owned = sorted(tp.partition for tp in assigned if tp.topic == contract.TELEMETRY)
        print(f"{READY_LINE}: broker {settings.bootstrap} ({flavor}), telemetry partitions {owned}", flush=True)

    parent = os.environ.get(PARENT_ENV)
    if parent:
        @app.timer(interval=1.0)
        async def exit_with_parent():  # a supervisor killed outright must not leave its workers running
            if os.getppid() != int(parent):
                os.kill(os.getpid(), signal.SIGTERM)  # Faust's clean stop

    return app


def run_worker(settings: Settings, *, loglevel: str = "warning") -> None:
    """Block until SIGINT/SIGTERM; Faust's worker stops the app cleanly on either."""
    app = build_app(settings)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
