# The holder role: a Celery worker started with --durability-holder consumes
# the holder shard queues on its own connection and threads, batches requests
# per key, runs rounds on a thread pool and answers each client. Rule: this
# package's import stays cheap (kombu only); Celery's worker machinery and the
# SQL store load when `install` runs.
from __future__ import annotations

from typing import TYPE_CHECKING

from ..queues import holder_queue_declaration, reply_queue_declaration

if TYPE_CHECKING:
    from ..registry import Configuration

__all__ = [
    "holder_queue_declaration",
    "install",
    "reply_queue_declaration",
]


def install(durability: Configuration) -> None:
    """Register the holder bootstep and its worker options on `durability.app`."""
    from .step import HolderStep, add_worker_options

    add_worker_options(durability.app)
    steps = durability.app.steps["worker"]
    if HolderStep not in steps:
        steps.add(HolderStep)
