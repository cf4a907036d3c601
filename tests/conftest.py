# Shared fixtures: real databases, real Redis, real Celery worker subprocesses.
# The helpers behind them live in tests/support.py (import them from there).
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import (
    Processes,
    _redis_ping_flush,
    create_postgres_database,
    reset_postgres,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "redis_db(n): the Redis DB number the `redis_url` fixture hands out"
    )


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database created for this test session, dropped (WITH FORCE) at the end."""
    url, drop = create_postgres_database()
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def fresh_postgres_url() -> Iterator[str]:
    """A brand-new database for one test (costs ~160 ms; prefer `database_url`)."""
    url, drop = create_postgres_database()
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file in this test's temp dir (no schema yet)."""
    return f"sqlite:///{tmp_path / 'durability.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An EMPTY database (no tables) for this test: SQLite file or PostgreSQL.

    PostgreSQL: one database per session whose public schema is dropped and
    recreated before each test. Call `migrate()` yourself.
    """
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'durability.db'}"
    url: str = request.getfixturevalue("postgres_url")
    reset_postgres(url)
    return url


@pytest.fixture
def redis_url_factory() -> Callable[[int], str]:
    """`redis_url_factory(db)`: PING (fail if down), FLUSHDB, return the URL of DB `db`."""
    return _redis_ping_flush


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """A flushed Redis DB. Choose the DB number (each engineer has their own) with
    `@pytest.mark.redis_db(n)` on the test/class/module, or `REDIS_DB = n` in the module."""
    marker = request.node.get_closest_marker("redis_db")
    db = marker.args[0] if marker else getattr(request.module, "REDIS_DB", None)
    if not isinstance(db, int):
        pytest.fail(
            "redis_url needs a DB number: add @pytest.mark.redis_db(n) or REDIS_DB = n "
            "to the test module (use one of the DB numbers assigned to your area)",
            pytrace=False,
        )
    return _redis_ping_flush(db)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Start workers/beat/anything; all are killed (process group) when the test ends.

    On failure, look at the logs in `processes.log_dir` (printed on teardown error).
    """
    log_dir = tmp_path / "proc-logs"
    log_dir.mkdir()
    procs = Processes(log_dir)
    try:
        yield procs
    finally:
        procs.stop_all()
