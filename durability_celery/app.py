# Binds semaphores and settings to one Celery app. Built once, at import time of
# the user's Celery module; it registers the holder step, the client gate and
# the beat task on the app, and every role finds its configuration through
# registry.py. Rule: the composition root; no module of the package imports it.
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from celery import Celery

from .client import SemaphoreClient
from .compat import check_versions
from .core.config import gathering_moment
from .errors import ConfigurationError
from .registry import configuration_for, is_configured, register
from .semaphore import DurabilitySemaphore
from .settings import DurabilitySettings
from .wire.routing import control_queue, holder_queue, shard_for


class Durability:
    """The durability-celery configuration of one Celery app."""

    def __init__(
        self,
        app: Any,
        semaphores: Iterable[DurabilitySemaphore],
        *,
        settings: DurabilitySettings | None = None,
    ) -> None:
        check_versions()  # an unsupported celery or kombu stops start-up with one line
        if not isinstance(app, Celery):
            raise ConfigurationError(f"app must be a Celery app, got {app!r}")
        if is_configured(app):
            raise ConfigurationError("this Celery app already has a Durability configuration")
        self.app = app
        self.settings = settings if settings is not None else DurabilitySettings()
        if not isinstance(self.settings, DurabilitySettings):
            raise ConfigurationError("settings must be a DurabilitySettings instance")
        self.semaphores: dict[str, DurabilitySemaphore] = {}
        for semaphore in semaphores:
            if not isinstance(semaphore, DurabilitySemaphore):
                raise ConfigurationError(f"not a DurabilitySemaphore: {semaphore!r}")
            if semaphore.name in self.semaphores:
                raise ConfigurationError(f"semaphore {semaphore.name!r} is configured twice")
            margin = self.settings.claim_margin_for(semaphore.config.grant_timeout)
            if margin >= semaphore.config.grant_timeout:
                raise ConfigurationError(
                    f"claim_margin ({margin}s) must be below the "
                    f"grant_timeout of semaphore {semaphore.name!r} "
                    f"({semaphore.config.grant_timeout}s), or no grant could ever be claimed"
                )
            prune_after = self.settings.prune_after
            if prune_after is not None and prune_after < semaphore.config.round_period:
                raise ConfigurationError(
                    f"prune_after ({prune_after}s) must be at least the round_period of "
                    f"semaphore {semaphore.name!r} ({semaphore.config.round_period}s)")
            self.semaphores[semaphore.name] = semaphore
        register(app, self)
        self._install()

    def _install(self) -> None:
        # Imported here: these modules import celery's worker internals, which a
        # plain producer process never needs to load.
        from .beat import install as install_beat
        from .holder import install as install_holder
        from .reconcile import install as install_reconcile
        from .worker import install as install_gate

        install_holder(self)
        install_gate(self)
        install_beat(self)
        install_reconcile(self)

    def semaphore(self, name: str) -> DurabilitySemaphore:
        """The semaphore called `name`, or a ConfigurationError naming the known ones."""
        try:
            return self.semaphores[name]
        except KeyError:
            known = ", ".join(sorted(self.semaphores)) or "none"
            raise ConfigurationError(f"unknown semaphore {name!r} (configured: {known})") from None

    def semaphore_client(self, name: str, *, client_id: str,
                         request_timeout: float | None = None,
                         clock: Callable[[], float] = time.time,
                         **options: Any) -> SemaphoreClient:
        """A client of semaphore `name` with these settings: lease support, the claim
        margin of its grant_timeout, its lease idle time, asking the holder's gathering
        moment early (SemaphoreClient.ask_early). `options` go to SemaphoreClient (the
        worker gate adds handoff and capacity)."""
        semaphore = self.semaphore(name)
        config, settings = semaphore.config, self.settings
        options.setdefault("ask_early", gathering_moment(config.round_wait))
        return SemaphoreClient(
            name, client_id=client_id, supports_leases=settings.supports_leases,
            claim_margin=settings.claim_margin_for(config.grant_timeout),
            request_timeout=settings.request_timeout if request_timeout is None
            else request_timeout,
            lease_idle=config.leases.idle if config.leases else None, clock=clock, **options)

    def queue_for(self, semaphore: str, key: str) -> str:
        """The holder queue that serves (semaphore, key)."""
        shard = shard_for(semaphore, key, self.settings.shards)
        return holder_queue(self.settings.queue_prefix, shard)

    def holder_queues(self, shards: Iterable[int] | None = None) -> list[str]:
        """Names of the holder queues for `shards` (all when None)."""
        chosen = range(self.settings.shards) if shards is None else shards
        return [holder_queue(self.settings.queue_prefix, s) for s in chosen]

    @property
    def control_queue(self) -> str:
        return control_queue(self.settings.queue_prefix)


def durability_for(app: Any) -> Durability:
    """The Durability configuration bound to `app` (ConfigurationError if none)."""
    return cast(Durability, configuration_for(app))  # only Durability registers
