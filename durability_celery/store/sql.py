# The SQL store: engines, one transaction per round with the key row locked,
# and rows <-> KeyState. Rule: this module keeps no policy; it loads a key's
# state under a lock, and `save` writes exactly the difference the pure core
# produced, in the same transaction, before the caller may answer anyone.
from __future__ import annotations

import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine, bindparam, delete, event, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, RowMapping, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from ..core.round import Blocked, KeyState
from ..core.state import Grant, Lease
from ..errors import ConfigurationError, InfrastructureError
from .schema import grants, keys, leases

SUPPORTED_DIALECTS = ("sqlite", "postgresql")
DEFAULT_BUSY_TIMEOUT = 30.0
"""Seconds a SQLite connection waits for another round's write lock before failing."""

_DELETE_CHUNK = 500  # ids per DELETE ... IN (...), well under SQLite's variable limit

_prepared: weakref.WeakSet[Engine] = weakref.WeakSet()


def create_engine(url: str, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> Engine:
    """An engine for `url`; `postgresql://` is served by psycopg 3, SQLite runs in WAL mode."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigurationError(f"database: not a database URL: {url!r}") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"database: {parsed.get_backend_name()!r} is not supported (use sqlite or postgresql)"
        )
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = sa.create_engine(parsed, connect_args={"timeout": busy_timeout})
        else:
            # A holder outlives database restarts: test pooled connections first.
            engine = sa.create_engine(parsed, pool_pre_ping=True)
    except (ArgumentError, ImportError) as exc:
        raise ConfigurationError(f"database: cannot create an engine for {url!r}: {exc}") from exc
    return prepare_engine(engine, busy_timeout=busy_timeout)


def prepare_engine(engine: Engine, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> Engine:
    """Make `engine` fit for rounds (idempotent); on SQLite, install WAL and BEGIN handling."""
    if engine.dialect.name not in SUPPORTED_DIALECTS:
        raise ConfigurationError(
            f"database: {engine.dialect.name!r} is not supported (use sqlite or postgresql)"
        )
    if engine.dialect.name == "sqlite" and engine not in _prepared:
        _install_sqlite_hooks(engine, busy_timeout)
        _prepared.add(engine)
    return engine


def _install_sqlite_hooks(engine: Engine, busy_timeout: float) -> None:
    # Python's sqlite3 would BEGIN lazily (only before DML), so a round's reads
    # could run outside its transaction. We emit BEGIN ourselves instead, and
    # BEGIN IMMEDIATE for writing transactions: that takes the write lock first,
    # so rounds for any key serialize and a read-then-write never deadlocks.
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        cursor.close()

    def on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("durability_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)


@contextmanager
def transaction(engine: Engine, *, write: bool) -> Iterator[Connection]:
    """One transaction; commits on success. A database failure raises InfrastructureError.

    `write=True` is a round's transaction (BEGIN IMMEDIATE on SQLite); a read
    transaction on PostgreSQL runs REPEATABLE READ so grants and leases are one
    snapshot.
    """
    try:
        with engine.connect() as conn:
            if write:
                conn.execution_options(durability_write=True)
            elif conn.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise InfrastructureError(f"database error ({type(exc).__name__}): {detail}") from exc


# --- loading ---------------------------------------------------------------


def _insert_key_if_missing(conn: Connection, semaphore: str, key: str) -> None:
    values = {"semaphore": semaphore, "key": key, "rounds": 0, "blocked": "[]"}
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(keys).values(**values).on_conflict_do_nothing())


def _key_clause(table: sa.Table, semaphore: str, key: str) -> sa.ColumnElement[bool]:
    return sa.and_(table.c.semaphore == semaphore, table.c.key == key)


def load(conn: Connection, semaphore: str, key: str) -> KeyState:
    """The state of (semaphore, key) for a round: its key row is inserted if missing and
    locked to commit before grants and leases are read, so a concurrent round for the
    same key waits here and then reads what that round committed."""
    state = read(conn, semaphore, key, lock=True)
    if state is None:
        # First round of this key. Two first rounds racing both insert; the
        # loser's insert does nothing (PostgreSQL waits for the winner's commit).
        _insert_key_if_missing(conn, semaphore, key)
        state = read(conn, semaphore, key, lock=True)
    assert state is not None  # the row exists now, and nothing here deletes key rows
    return state


def read(conn: Connection, semaphore: str, key: str, *, lock: bool = False) -> KeyState | None:
    """The state of (semaphore, key), or None when it has no key row; never inserts.

    With `lock`, the key row stays locked (FOR UPDATE) until the transaction ends.
    """
    query = select(keys).where(_key_clause(keys, semaphore, key))
    if lock:
        query = query.with_for_update()
    row = conn.execute(query).mappings().first()
    if row is None:
        return None
    grant_rows = conn.execute(
        select(grants).where(_key_clause(grants, semaphore, key))
        .order_by(grants.c.created_at, grants.c.grant_id)
    ).mappings()
    lease_rows = conn.execute(
        select(leases).where(_key_clause(leases, semaphore, key))
        .order_by(leases.c.issued_at, leases.c.lease_id)
    ).mappings()
    return KeyState(
        semaphore=semaphore,
        key=key,
        grants=tuple(_grant(r) for r in grant_rows),
        leases=tuple(_lease(r) for r in lease_rows),
        last_round_at=row["last_round_at"],
        rounds=row["rounds"],
        limit=row["limit"],
        blocked=_blocked_from_json(row["blocked"]),
    )


def _grant(row: RowMapping) -> Grant:
    return Grant(
        grant_id=row["grant_id"], client_id=row["client_id"], group=row["group"],
        permits=row["permits"], claimed=row["claimed"], released=row["released"],
        created_at=row["created_at"], claim_deadline=row["claim_deadline"],
        status=row["status"],
    )


def _lease(row: RowMapping) -> Lease:
    return Lease(
        lease_id=row["lease_id"], client_id=row["client_id"], group=row["group"],
        permits=row["permits"], drawn=row["drawn"], released=row["released"],
        issued_at=row["issued_at"], last_report_at=row["last_report_at"],
        status=row["status"], confirmed=bool(row["confirmed"]),
        issued_limit=row["issued_limit"], issued_group_limit=row["issued_group_limit"],
    )


def _blocked_from_json(raw: str | None) -> tuple[Blocked, ...]:
    entries = json.loads(raw) if raw else []
    return tuple(Blocked(group=e["group"], reason=e["reason"], queued=e["queued"]) for e in entries)


def _blocked_to_json(blocked: Sequence[Blocked]) -> str:
    return json.dumps([{"group": b.group, "reason": b.reason, "queued": b.queued} for b in blocked])


# --- saving ----------------------------------------------------------------


def _grant_row(grant: Grant) -> dict[str, Any]:
    return {
        "client_id": grant.client_id, "group": grant.group, "permits": grant.permits,
        "claimed": grant.claimed, "released": grant.released, "created_at": grant.created_at,
        "claim_deadline": grant.claim_deadline, "status": grant.status,
    }


def _lease_row(lease: Lease) -> dict[str, Any]:
    return {
        "client_id": lease.client_id, "group": lease.group, "permits": lease.permits,
        "drawn": lease.drawn, "released": lease.released, "issued_at": lease.issued_at,
        "last_report_at": lease.last_report_at, "status": lease.status,
        "confirmed": lease.confirmed, "issued_limit": lease.issued_limit,
        "issued_group_limit": lease.issued_group_limit,
    }


def _write_diff(conn: Connection, table: sa.Table, id_column: str, semaphore: str, key: str,
                old: Mapping[str, dict[str, Any]], new: Mapping[str, dict[str, Any]]) -> bool:
    """Insert, update and delete rows of one table by id; True if anything was written."""
    inserted = [{"semaphore": semaphore, "key": key, id_column: i, **row}
                for i, row in new.items() if i not in old]
    updated = [{"b_id": i, **row} for i, row in new.items() if i in old and old[i] != row]
    deleted = [i for i in old if i not in new]
    ident = table.c[id_column]
    if inserted:
        conn.execute(insert(table), inserted)
    if updated:
        # Key columns are bound literally; the varying id comes from each row.
        stmt = (update(table).where(_key_clause(table, semaphore, key))
                .where(ident == bindparam("b_id")))
        conn.execute(stmt, updated)
    for start in range(0, len(deleted), _DELETE_CHUNK):
        chunk = deleted[start:start + _DELETE_CHUNK]
        conn.execute(delete(table).where(_key_clause(table, semaphore, key), ident.in_(chunk)))
    return bool(inserted or updated or deleted)


def _key_row(state: KeyState) -> dict[str, Any]:
    return {
        "last_round_at": state.last_round_at, "rounds": state.rounds, "limit": state.limit,
        "next_claim_deadline": state.next_claim_deadline,
        "blocked": _blocked_to_json(state.blocked),
    }


def save(conn: Connection, old: KeyState, new: KeyState, *, now: float | None = None) -> None:
    """Write what changed from `old` (as loaded) to `new`, inside the caller's transaction.

    Grants and leases absent from `new` are deleted. The key row is written
    only when something changed; `now` stamps its `updated_at`.
    """
    if (old.semaphore, old.key) != (new.semaphore, new.key):
        raise ValueError("save: old and new state belong to different keys")
    semaphore, key = new.semaphore, new.key
    changed = _write_diff(
        conn, grants, "grant_id", semaphore, key,
        {g.grant_id: _grant_row(g) for g in old.grants},
        {g.grant_id: _grant_row(g) for g in new.grants},
    )
    changed |= _write_diff(
        conn, leases, "lease_id", semaphore, key,
        {lease.lease_id: _lease_row(lease) for lease in old.leases},
        {lease.lease_id: _lease_row(lease) for lease in new.leases},
    )
    row = _key_row(new)
    if changed or row != _key_row(old):
        conn.execute(
            update(keys).where(_key_clause(keys, semaphore, key))
            .values(**row, updated_at=now if now is not None else new.last_round_at)
        )


# --- queries for the holder's timer and beat -------------------------------


def deadlines(conn: Connection, semaphore: str, *,
              due_by: float | None = None) -> list[tuple[str, float]]:
    """(key, next claim deadline) of `semaphore`'s keys that have one, earliest first.

    With `due_by`, only deadlines at or before it.
    """
    query = (select(keys.c.key, keys.c.next_claim_deadline)
             .where(keys.c.semaphore == semaphore, keys.c.next_claim_deadline.is_not(None))
             .order_by(keys.c.next_claim_deadline, keys.c.key))
    if due_by is not None:
        query = query.where(keys.c.next_claim_deadline <= due_by)
    return [(k, float(d)) for k, d in conn.execute(query)]


def all_keys(conn: Connection, semaphore: str | None = None) -> list[tuple[str, str]]:
    """Every (semaphore, key) with a key row, optionally for one semaphore."""
    query = select(keys.c.semaphore, keys.c.key).order_by(keys.c.semaphore, keys.c.key)
    if semaphore is not None:
        query = query.where(keys.c.semaphore == semaphore)
    return [(s, k) for s, k in conn.execute(query)]
