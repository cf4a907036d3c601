# One running holder: the dispatcher thread (scheduling, replies) and the
# consumer thread (shard queues), wired to one Durability configuration.
# Rule: start and stop are the only entry points; everything else happens on
# the holder's own threads, never on the worker's event loop.
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from .. import store
from ..wire.routing import shard_for
from .consumer import HolderConsumer
from .dispatcher import Dispatcher
from .replies import ReplyPublisher

if TYPE_CHECKING:
    from ..metrics import HolderMetrics
    from ..registry import Configuration
    from ..semaphore import DurabilitySemaphore

logger = logging.getLogger("durability_celery.holder")


class Holder:
    """The holder role for `shards` (all shards when None) of one Durability configuration."""

    def __init__(self, durability: Configuration, *, shards: Iterable[int] | None = None,
                 clock: Callable[[], float] = time.time,
                 metrics: HolderMetrics | None = None) -> None:
        settings = durability.settings
        self.shards = sorted(set(range(settings.shards) if shards is None else shards))
        served = frozenset(self.shards)

        def serves(semaphore: str, key: str) -> bool:
            return shard_for(semaphore, key, settings.shards) in served

        semaphores: dict[str, Any] = dict(durability.semaphores)
        if metrics is not None:
            semaphores = {name: Counted(s, metrics) for name, s in semaphores.items()}
        self.dispatcher = Dispatcher(
            semaphores=semaphores,
            serves=serves,
            publisher=ReplyPublisher(durability.app, reply_expires=settings.reply_expires,
                                     sent=metrics.reply if metrics else None),
            round_threads=settings.round_threads,
            scan_interval=settings.reclaim_interval,
            clock=clock,
            metrics=metrics,
        )
        self._semaphores = durability.semaphores
        self.consumer = HolderConsumer(
            app=durability.app,
            queue_names=durability.holder_queues(self.shards),
            semaphores=durability.semaphores,
            dispatcher=self.dispatcher,
            clock=clock,
            queue_arguments=durability.settings.shard_queue_arguments,
        )

    def start(self) -> None:
        logger.info("durability holder: starting for shards %s", _ranges(self.shards))
        self._check_schemas()
        self.dispatcher.start()
        self.consumer.start()

    def _check_schemas(self) -> None:
        """Refuse to serve a database an older library version laid out (every round
        would fail); one that cannot be reached now is retried by the rounds."""
        engines = {id(s.engine): (name, s.engine) for name, s in self._semaphores.items()}
        for name, engine in engines.values():
            try:
                found = store.check_version(engine)
            except SQLAlchemyError as exc:  # the database is down: rounds retry and log it
                logger.warning("durability holder: cannot check the schema of %r: %r",
                               name, exc)
                continue
            if found is None:
                logger.warning("durability holder: no schema in the database of %r; run "
                               "`durability-celery migrate`", name)

    def stop(self, *, timeout: float = 15.0) -> None:
        """Stop consuming first, then let running rounds answer (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        self.consumer.stop(timeout=max(0.1, deadline - time.monotonic()))
        self.dispatcher.stop(timeout=max(0.1, deadline - time.monotonic()))
        logger.info("durability holder: stopped")


class Counted:
    """A semaphore as the dispatcher sees it, with its rounds, reclaims and deadline scans
    counted in the holder's metrics: the store's calls are where each one happens."""

    def __init__(self, semaphore: DurabilitySemaphore, metrics: HolderMetrics) -> None:
        self._semaphore = semaphore
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)

    def run_rounds(self, batch: Sequence[tuple[str, Sequence[object]]],
                   **options: Any) -> list[Any]:
        started = time.monotonic()
        results: list[Any] | None = None
        try:
            results = self._semaphore.run_rounds(batch, **options)
            return results
        finally:
            self._metrics.batch(self._semaphore.name, [key for key, _ in batch],
                                time.monotonic() - started, results)

    def reclaim(self, key: str, **options: Any) -> float | None:
        try:
            return self._semaphore.reclaim(key, **options)
        except Exception:
            self._metrics.errors.labels(self._semaphore.name, "reclaim").inc()
            raise

    def deadlines(self) -> list[tuple[str, float]]:
        try:
            return self._semaphore.deadlines()
        except Exception:
            self._metrics.errors.labels(self._semaphore.name, "scan").inc()
            raise


def parse_shards(spec: str | None, shards: int) -> list[int] | None:
    """`"0-7,9"` -> [0..7, 9]; None or empty -> None (every shard). ValueError names the problem."""
    if spec is None or not spec.strip():
        return None
    chosen: set[int] = set()
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not N or N-M") from None
        if not 0 <= first <= last < shards:
            raise ValueError(
                f"{part.strip()!r} is outside 0-{shards - 1} "
                f"(DurabilitySettings.shards={shards})"
            )
        chosen.update(range(first, last + 1))
    return sorted(chosen)


def _ranges(shards: list[int]) -> str:
    parts: list[str] = []
    for shard in shards:
        if parts and parts[-1].split("-")[-1] == str(shard - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{shard}"
        else:
            parts.append(str(shard))
    return ",".join(parts)
