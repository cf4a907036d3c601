# Fixtures of the SQL store tests: a migrated DurabilitySemaphore on each backend
# (SQLite file, PostgreSQL database of this session), and wire-message builders.
from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery import store
from durability_celery.semaphore import DurabilitySemaphore

SemFactory = Callable[..., DurabilitySemaphore]


class FakeClock:
    """An injected clock that moves only when told."""

    def __init__(self, now: float = 1_764_450_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_sem(database_url: str) -> Iterator[SemFactory]:
    """`make_sem(limit=3, ...)`: a semaphore with a unique name on a migrated database."""
    made: list[DurabilitySemaphore] = []

    def factory(**options: Any) -> DurabilitySemaphore:
        options.setdefault("limit", 3)
        name = options.pop("name", f"sem-{secrets.token_hex(3)}")
        sem = DurabilitySemaphore(name, database=database_url, **options)
        sem.migrate()
        made.append(sem)
        return sem

    try:
        yield factory
    finally:
        for sem in made:
            sem.close()


def request(sem: DurabilitySemaphore, key: str, client_id: str, *,
            demand: Sequence[tuple[str | None, int, float]] = (),
            grants: Sequence[tuple[str, int, int]] = (),
            leases: Sequence[tuple[str, int, int, bool]] = (),
            supports_leases: bool = False) -> dict[str, Any]:
    """A version-1 request message."""
    return {
        "type": "request", "v": 1, "semaphore": sem.name, "key": key, "client_id": client_id,
        "demand": [{"group": g, "count": c, "oldest_at": t} for g, c, t in demand],
        "grants": [{"grant_id": i, "claimed": c, "released": r} for i, c, r in grants],
        "leases": [{"lease_id": i, "drawn": d, "released": r, "stopped": s}
                   for i, d, r, s in leases],
        "supports_leases": supports_leases,
    }


def table_rows(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every store table, sorted: to compare a database before and after."""
    with engine.connect() as conn:
        return {
            table.name: sorted(tuple(row) for row in conn.execute(sa.select(table)))
            for table in (store.grants, store.leases, store.keys)
        }


def fresh_engine(url: str) -> sa.Engine:
    """A second engine (its own pool and connections) on the same database."""
    return store.create_engine(url)
