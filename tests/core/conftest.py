# The `make_semaphore` fixture: the same rule table runs on the in-memory store
# (MemorySemaphore) and on SQLite and PostgreSQL through DurabilitySemaphore.
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from core_harness import SEM, Limits

from durability_celery.core.usage import Usage
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.store.memory import MemorySemaphore


class StoredSemaphore:
    """DurabilitySemaphore with the MemorySemaphore call shape used by the tests."""

    def __init__(self, url: str, limits: Limits, **settings: Any) -> None:
        self.limits = limits
        self.sem = DurabilitySemaphore(
            SEM, database=url, limit=limits.limit, group_limit=limits.group_limit,
            can_grant=limits.can_grant, **settings,
        )
        self.sem.migrate()

    def run_round(self, key: str, messages: Sequence[object], now: float) -> list[dict[str, Any]]:
        return self.sem.run_round(key, list(messages), now=now)

    def reclaim(self, key: str, now: float) -> float | None:
        return self.sem.reclaim(key, now=now)

    def usage(self, key: str, now: float) -> Usage:
        return self.sem.usage(key, now=now)


MakeSemaphore = Callable[..., "MemorySemaphore | StoredSemaphore"]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def make_semaphore(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeSemaphore]:
    made: list[StoredSemaphore] = []

    def make(limits: Limits | None = None, **settings: Any) -> MemorySemaphore | StoredSemaphore:
        limits = limits or Limits()
        if request.param == "memory":
            return MemorySemaphore(SEM, limits, **settings)
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / f'db{len(made)}.db'}"
        else:
            url = request.getfixturevalue("postgres_url")
            DurabilitySemaphore.migrate(url, None)  # each semaphore starts from no schema
        stored = StoredSemaphore(url, limits, **settings)
        made.append(stored)
        return stored

    yield make
    for stored in made:
        stored.sem.close()
