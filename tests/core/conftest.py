# The `make_semaphore` fixture: the same rule table runs on every Store, the
# in-memory one (MemorySemaphore) and the SQL one (DurabilitySemaphore) on SQLite
# and PostgreSQL.
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from core_harness import SEM, Limits

from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.store import MemorySemaphore, Store

MakeSemaphore = Callable[..., Store]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def make_semaphore(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeSemaphore]:
    made: list[DurabilitySemaphore] = []

    def make(limits: Limits | None = None, **settings: Any) -> Store:
        limits = limits or Limits()
        if request.param == "memory":
            return MemorySemaphore(SEM, limits, **settings)
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / f'db{len(made)}.db'}"
        else:
            url = request.getfixturevalue("postgres_url")
            DurabilitySemaphore.migrate(url, None)  # each semaphore starts from no schema
        stored = DurabilitySemaphore(
            SEM, database=url, limit=limits.limit, group_limit=limits.group_limit,
            can_grant=limits.can_grant, **settings,
        )
        stored.migrate()
        made.append(stored)
        return stored

    yield make
    for stored in made:
        stored.close()
