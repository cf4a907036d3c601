# Engines and transactions of the SQL store. Rule: a round's transaction
# serializes with every other round of its key before it reads anything
# (SQLite: BEGIN IMMEDIATE; PostgreSQL: the key row locks taken in store.sql),
# and any database failure leaves as InfrastructureError after a rollback.
# Connections are not pinged on checkout (a SELECT 1 would be a commit of its
# own per round): `run_transaction` runs its body again, once, when the connection
# turns out dead before the commit, as a pooled one does after a restart.
from __future__ import annotations

import logging
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import Engine, event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

from ..errors import ConfigurationError, InfrastructureError, SchemaMissing

logger = logging.getLogger("durability_celery.store")

SUPPORTED_DIALECTS = ("sqlite", "postgresql")
DEFAULT_BUSY_TIMEOUT = 30.0
"""Seconds a SQLite connection waits for another round's write lock before failing."""

_prepared: weakref.WeakSet[Engine] = weakref.WeakSet()


def create_engine(url: str, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
                  setting: str = "database") -> Engine:
    """An engine for `url`; `postgresql://` is served by psycopg 3, SQLite runs in WAL mode.

    `setting` is what errors name: where the user typed the URL (an argument, a flag,
    an environment variable)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigurationError(f"{setting}: not a database URL: {url!r}") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"{setting}: {backend!r} is not supported (use sqlite or postgresql)"
        )
    try:
        if backend == "sqlite":
            engine = sa.create_engine(parsed, connect_args={"timeout": busy_timeout})
        else:
            engine = sa.create_engine(parsed)
    except (ArgumentError, ImportError) as exc:
        raise ConfigurationError(
            f"{setting}: cannot create an engine for {url!r}: {exc}") from exc
    return prepare_engine(engine, busy_timeout=busy_timeout)


def prepare_engine(engine: Engine, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> Engine:
    """Make `engine` fit for rounds (idempotent); on SQLite, install WAL and BEGIN handling."""
    if engine.dialect.name not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"database: {engine.dialect.name!r} is not supported (use sqlite or postgresql)"
        )
    if engine.dialect.name == "sqlite" and _in_memory(engine.url):
        raise ConfigurationError(
            "database: an in-memory SQLite database belongs to one connection, so rounds "
            "on other connections would not see it; use a file, e.g. sqlite:///durability.db"
        )
    if engine.dialect.name == "sqlite" and engine not in _prepared:
        _install_sqlite_hooks(engine, busy_timeout)
        _prepared.add(engine)
    return engine


def _in_memory(url: sa.URL) -> bool:
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def _switch_to_wal(cursor: Any, busy_timeout: float) -> None:
    """PRAGMA journal_mode=WAL, retried while another connection holds the lock.

    SQLite answers this pragma SQLITE_BUSY at once, without its busy handler,
    when another connection is switching the same fresh file: two holders
    starting together failed about one time in seven ("database is locked").
    """
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _install_sqlite_hooks(engine: Engine, busy_timeout: float) -> None:
    # Python's sqlite3 would BEGIN lazily (only before DML), so a round's reads
    # could run outside its transaction. We emit BEGIN ourselves instead, and
    # BEGIN IMMEDIATE for writing transactions: that takes the write lock first,
    # so rounds serialize and a read-then-write never fails to upgrade its lock.
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        _switch_to_wal(cursor, busy_timeout)
        cursor.close()

    def on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("durability_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)


T = TypeVar("T")


def _configure(conn: Connection, write: bool) -> None:
    postgres = conn.dialect.name == "postgresql"
    if write:
        conn.execution_options(durability_write=True)
        if postgres:
            # After waiting for the key row lock, a round must read what the
            # previous round committed: READ COMMITTED, whatever the engine's default.
            conn.execution_options(isolation_level="READ COMMITTED")
    elif postgres:
        conn.execution_options(isolation_level="REPEATABLE READ")


def _infrastructure_error(exc: SQLAlchemyError) -> InfrastructureError:
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    if _missing_table(exc):
        return SchemaMissing(f"the database has no durability schema ({detail}): run "
                             "`durability-celery migrate`")
    return InfrastructureError(f"database error ({type(exc).__name__}): {detail}")


def _missing_table(exc: SQLAlchemyError) -> bool:
    """Whether a statement failed for want of a table: the store queries only its own
    tables, so the schema was never created (or was dropped), which no retry mends."""
    orig = getattr(exc, "orig", None)
    if getattr(orig, "sqlstate", None) == "42P01":  # PostgreSQL: undefined_table
        return True
    return isinstance(orig, sqlite3.OperationalError) and str(orig).startswith("no such table")


@contextmanager
def transaction(engine: Engine, *, write: bool) -> Iterator[Connection]:
    """One transaction; commits on success. A database failure raises InfrastructureError.

    `write=True` is a round's transaction (BEGIN IMMEDIATE on SQLite); a read
    transaction on PostgreSQL runs REPEATABLE READ so grants and leases are one
    snapshot.
    """
    try:
        with engine.connect() as conn:
            _configure(conn, write)
            with conn.begin():
                yield conn
    except SQLAlchemyError as exc:
        raise _infrastructure_error(exc) from exc


class _DeadBeforeCommit(Exception):
    """The body of a transaction found its connection dead: nothing was committed."""


def _attempt(engine: Engine, body: Callable[[Connection], T], write: bool, retry: bool) -> T:
    with engine.connect() as conn:
        _configure(conn, write)
        with conn.begin():
            try:
                return body(conn)
            except DBAPIError as exc:
                if retry and exc.connection_invalidated:
                    raise _DeadBeforeCommit() from exc
                raise


def run_transaction(engine: Engine, body: Callable[[Connection], T], *, write: bool) -> T:
    """`body(conn)` in one `transaction`, committed on return; run once more on a fresh
    connection if the first one was found dead before the commit (a failed commit is
    never retried: it may have committed). The body must have no effect but on `conn`.
    """
    try:
        try:
            return _attempt(engine, body, write, retry=True)
        except _DeadBeforeCommit as dead:
            logger.warning("durability: database connection lost (%s); trying again",
                           dead.__cause__)
        return _attempt(engine, body, write, retry=False)
    except SQLAlchemyError as exc:
        raise _infrastructure_error(exc) from exc
