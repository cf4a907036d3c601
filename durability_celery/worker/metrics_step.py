# The Celery side of the metrics: the `--durability-metrics-port` worker option
# and a worker bootstep that serves the process's durability_* series on it
# (docs/operations.md, "Metrics"). The holder step and the gate step find them
# on the worker (metrics.served_by). Rule: the port is taken while the worker
# is built, so a port that cannot be had stops the worker before anything of it
# runs; a worker started without the option serves nothing and counts nothing.
from __future__ import annotations

import logging
from typing import Any

import click
from celery import bootsteps

from ..metrics import Metrics

logger = logging.getLogger("durability_celery.worker")

OPTION = "--durability-metrics-port"


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Serves /metrics in a worker started with --durability-metrics-port."""

    label = "Durability metrics"

    def __init__(self, parent: Any, durability_metrics_port: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.metrics: Metrics | None = None
        parent.durability_metrics = None
        if durability_metrics_port is None:
            return
        from ..app import durability_for

        settings = durability_for(parent.app).settings
        metrics = Metrics(key_labels=settings.metrics_key_labels)
        try:
            metrics.serve(durability_metrics_port)
        except OSError as exc:
            # A ClickException: the `celery worker` command prints it as one line.
            raise click.ClickException(
                f"{OPTION} {durability_metrics_port}: cannot serve metrics on that port: "
                f"{exc.strerror or exc}") from None
        logger.info("durability: serving metrics on port %d (/metrics)",
                    durability_metrics_port)
        self.metrics = parent.durability_metrics = metrics

    def create(self, parent: Any) -> MetricsStep:
        return self

    def start(self, parent: Any) -> None:
        pass  # serving since the worker was built

    def stop(self, parent: Any) -> None:
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            metrics.close()

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)


def add_worker_options(app: Any) -> None:
    """The worker option of the metrics (idempotent per app)."""
    options = app.user_options["worker"]
    if any(OPTION in getattr(o, "opts", ()) for o in options):
        return
    options.add(click.Option(
        [OPTION], type=click.IntRange(1, 65535), default=None, metavar="PORT",
        help="Serve Prometheus metrics (durability_*) on this port at /metrics.",
    ))
