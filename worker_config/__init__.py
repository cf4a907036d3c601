# The ready Celery app for all three roles, configured from environment
# variables (see worker_config/env.py and docs/configuration.md):
#   celery -A worker_config worker                        # client worker
#   celery -A worker_config worker --durability-holder    # holder worker
#   celery -A worker_config beat                          # beat (reclaim safety net)
# Rule: with no variables set, everything runs on one machine with no server
# (filesystem broker and a SQLite file under ./.durability/); a bad variable
# stops start-up with one line naming it. The app is built on first access of
# `worker_config.app`, so importing `worker_config.env` alone has no effects.
from __future__ import annotations

import os
from typing import Any

from celery import Celery

from durability_celery.app import Durability
from durability_celery.errors import ConfigurationError

from .env import (
    EnvError,
    WorkerConfig,
    build_semaphore,
    load_config,
    make_home,
    parse_semaphores,
)

__all__ = [
    "EnvError",
    "WorkerConfig",
    "app",
    "build_app",
    "celery_settings",
    "config",
    "durability",
    "load_config",
    "parse_semaphores",
]


def celery_settings(config: WorkerConfig) -> dict[str, Any]:
    """Celery settings that are safe with admission control (see celery-notes, section 3)."""
    return {
        "broker_url": config.broker_url,
        "broker_transport_options": dict(config.broker_transport_options),
        "broker_connection_retry_on_startup": True,
        "result_backend": config.result_backend,
        "task_ignore_result": config.result_backend is None,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        # A held message is outside the pool; prefetch is raised per held message
        # by the gate, so the base prefetch stays minimal.
        "worker_prefetch_multiplier": 1,
        # acks_late would redeliver running tasks on connection loss and spend
        # permits twice; the gate acks when the pool starts the task.
        "task_acks_late": False,
        "task_reject_on_worker_lost": False,
        "imports": list(config.imports),
        "beat_schedule_filename": str(config.home / "celerybeat-schedule"),
        "worker_hijack_root_logger": True,
    }


def build_app(config: WorkerConfig, *, main: str = "worker_config") -> tuple[Celery, Durability]:
    """A Celery app plus its Durability configuration, built from `config`."""
    from durability_celery import store

    make_home(config)
    celery_app = Celery(main)
    celery_app.conf.update(celery_settings(config))
    try:
        engine = store.create_engine(config.database_url)
    except ConfigurationError as exc:
        raise EnvError("DURABILITY_DATABASE_URL", str(exc)) from None
    semaphores = []
    for spec in config.semaphores:
        try:
            semaphores.append(build_semaphore(spec, engine))
        except ConfigurationError as exc:
            raise EnvError("DURABILITY_SEMAPHORES", f"semaphore {spec.name!r}: {exc}") from None
    return celery_app, Durability(celery_app, semaphores, settings=config.settings)


_built: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    if not _built:
        try:
            config = load_config(os.environ)
            app, durability = build_app(config)
        except ConfigurationError as exc:
            # `celery -A worker_config` would print a long traceback for any
            # import error; a configuration mistake deserves one line naming
            # the variable.
            raise SystemExit(f"worker_config: {exc}") from None
        _built.update(config=config, app=app, durability=durability)
    return _built


def __getattr__(name: str) -> Any:
    # Built on first use, not at import: `worker_config.env` (used by the CLI to
    # read the configuration) must be importable without starting anything.
    if name in ("app", "durability", "config"):
        return _build()[name]
    raise AttributeError(f"module 'worker_config' has no attribute {name!r}")
