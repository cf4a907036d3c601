# The Celery side of the holder: the `--durability-holder` worker option and a
# worker bootstep that runs a Holder on its own threads. Rule: the step only
# starts and stops the Holder; a worker started without the flag is untouched.
from __future__ import annotations

import logging
from typing import Any

import click
from celery import bootsteps

from ..errors import ConfigurationError
from ..metrics import served_by
from ..registry import configuration_for
from .service import Holder, parse_shards

logger = logging.getLogger("durability_celery.holder")


class HolderStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Runs the holder in a worker started with --durability-holder."""

    label = "Durability holder"

    def __init__(self, parent: Any, durability_holder: bool = False,
                 durability_shards: str | None = None, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(durability_holder)
        self.holder: Holder | None = None
        self.shards: list[int] | None = None
        if self.enabled:
            # Checked while the worker is built, so a bad flag stops it at start-up.
            self.durability = configuration_for(parent.app)
            try:
                self.shards = parse_shards(durability_shards, self.durability.settings.shards)
            except ValueError as exc:
                raise ConfigurationError(f"--durability-shards: {exc}") from None

    def create(self, parent: Any) -> HolderStep:
        return self

    def start(self, parent: Any) -> None:
        metrics = served_by(parent)
        self.holder = Holder(self.durability, shards=self.shards,
                             metrics=metrics.holder() if metrics else None)
        self.holder.start()

    def stop(self, parent: Any) -> None:
        holder, self.holder = self.holder, None
        if holder is not None:
            holder.stop()

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)


def add_worker_options(app: Any) -> None:
    """The worker command-line options of the holder role (idempotent per app)."""
    options = app.user_options["worker"]
    if any("--durability-holder" in getattr(o, "opts", ()) for o in options):
        return
    options.add(click.Option(
        ["--durability-holder"], is_flag=True, default=False,
        help="Run the durability holder in this worker (consumes the holder shard queues).",
    ))
    options.add(click.Option(
        ["--durability-shards"], default=None, metavar="SHARDS", callback=_check_shards,
        help="Holder shards to serve, e.g. 0-7,9 (default: all).",
    ))


def _check_shards(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A bad shard list stops the worker with click's one-line usage error, before the
    worker starts (the step checks again, for a worker built without this command line)."""
    if value is None:
        return None  # every shard: nothing to check, and no need to look at the app
    app = getattr(ctx.obj, "app", None)  # celery's CLIContext
    try:
        shards = configuration_for(app).settings.shards
    except ConfigurationError:
        return value  # no Durability on this app: the step says so if it runs a holder
    try:
        parse_shards(value, shards)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value
