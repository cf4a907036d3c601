# Finds the Durability configuration of a Celery app. app.py composes it and
# registers it here; the roles it installs (holder, gate, beat, reconcile) and
# the blocking client see it through `Configuration` and look it up here, so
# nothing imports app.py back and app.py stays the one composition root.
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .client import SemaphoreClient
from .errors import ConfigurationError
from .semaphore import DurabilitySemaphore
from .settings import DurabilitySettings


class Configuration(Protocol):
    """What the roles read of one app's Durability configuration (app.Durability)."""

    @property
    def app(self) -> Any: ...

    @property
    def settings(self) -> DurabilitySettings: ...

    @property
    def semaphores(self) -> dict[str, DurabilitySemaphore]: ...

    @property
    def control_queue(self) -> str: ...

    def semaphore(self, name: str) -> DurabilitySemaphore: ...

    def semaphore_client(self, name: str, *, client_id: str,
                         request_timeout: float | None = None,
                         clock: Callable[[], float] = ...,
                         **options: Any) -> SemaphoreClient: ...

    def queue_for(self, semaphore: str, key: str) -> str: ...

    def holder_queues(self, shards: Iterable[int] | None = None) -> list[str]: ...


_REGISTRY: weakref.WeakKeyDictionary[Any, Configuration] = weakref.WeakKeyDictionary()


def register(app: Any, configuration: Configuration) -> None:
    """Bind `configuration` to `app`; app.Durability checks `is_configured` first."""
    _REGISTRY[app] = configuration


def is_configured(app: Any) -> bool:
    return app in _REGISTRY


def configuration_for(app: Any) -> Configuration:
    """The configuration bound to `app` (ConfigurationError if none)."""
    try:
        return _REGISTRY[app]
    except (KeyError, TypeError):
        raise ConfigurationError(
            "this Celery app has no Durability configuration: create "
            "Durability(app, [semaphores...]) in the module that defines the app"
        ) from None


def configuration_of(app_or_configuration: Any) -> Configuration:
    """`app_or_configuration` itself when it is a registered configuration, else the
    configuration bound to it as a Celery app."""
    known = [found for found in _REGISTRY.values() if found is app_or_configuration]
    return known[0] if known else configuration_for(app_or_configuration)
