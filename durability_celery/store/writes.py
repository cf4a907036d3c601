# KeyState -> rows: writes the difference the pure core produced, for one key or
# a batch of keys, in the caller's transaction and before anyone may be
# answered. Rule: no policy here; the diff of a whole batch is collected first,
# then each kind of write (insert, update, delete per table, key rows) is one
# bulk statement, so a batch costs about as many network exchanges as one key.
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import insert
from sqlalchemy.engine import Connection

from ..core.round import KeyState
from .sql import (
    _COPY_FROM,
    _DELETE_CLIENT,
    _GRANTS,
    _LEASES,
    _TOUCH_CLIENT,
    _UPDATE_KEY,
    _UPSERT_CLIENTS_POSTGRES,
    _UPSERT_CLIENTS_SQLITE,
    _WRITE_KEYS_POSTGRES,
    Revisions,
    _blocked_to_json,
    _postgres,
    _Statements,
)


def save(conn: Connection, old: KeyState, new: KeyState, *, now: float | None = None) -> None:
    """`save_many` of one key."""
    save_many(conn, [(old, new)], now=now)


def save_many(conn: Connection, changes: Iterable[tuple[KeyState, KeyState]], *,
              now: float | None = None) -> Revisions:
    """Write what changed from each `old` (as loaded) to its `new`, inside the caller's
    transaction.

    Grants and leases absent from `new` are deleted. A key row is written whenever
    something of its key changed (store.cache relies on it); `now` stamps its
    `updated_at`. Returns the revision of each (semaphore, key) row written, on
    PostgreSQL (store.cache).
    """
    grants, leases, clients = _TableWrites(_GRANTS), _TableWrites(_LEASES), _ClientWrites()
    key_rows: list[dict[str, Any]] = []
    for old, new in changes:
        if (old.semaphore, old.key) != (new.semaphore, new.key):
            raise ValueError("save: old and new state belong to different keys")
        where = {"b_semaphore": new.semaphore, "b_key": new.key}
        changed = grants.add(where, old.grants, new.grants)
        changed |= leases.add(where, old.leases, new.leases)
        changed |= clients.add(where, old, new)
        row = _key_row(new)
        if changed or row != _key_row(old):
            stamp = now if now is not None else new.last_round_at
            key_rows.append({**where, **row, "updated_at": stamp})
    grants.flush(conn)
    leases.flush(conn)
    clients.flush(conn)
    if key_rows and _postgres(conn):
        return _WRITE_KEYS_POSTGRES.execute(conn, [  # by (semaphore, key), its primary key
            {"semaphore": r.pop("b_semaphore"), "key": r.pop("b_key"), **r} for r in key_rows])
    if key_rows:
        conn.execute(_UPDATE_KEY, key_rows)
    return {}


def _key_row(state: KeyState) -> dict[str, Any]:
    return {
        "last_round_at": state.last_round_at, "rounds": state.rounds, "limit": state.limit,
        "next_claim_deadline": state.next_claim_deadline,
        "blocked": _blocked_to_json(state.blocked),
    }


class _TableWrites:
    """Inserts, updates and deletes of one grant/lease table, collected over keys."""

    def __init__(self, stmts: _Statements) -> None:
        self.stmts = stmts
        self.inserted: list[dict[str, Any]] = []
        self.updated: list[dict[str, Any]] = []
        self.deleted: list[tuple[dict[str, str], list[str]]] = []

    def add(self, where: dict[str, str], old: Iterable[Any], new: Iterable[Any]) -> bool:
        """Collect one key's changes by id; True if it has any."""
        stmts = self.stmts
        old_by_id = {getattr(item, stmts.id_column): item for item in old}
        new_ids = set()
        changed = False
        for item in new:
            ident = getattr(item, stmts.id_column)
            new_ids.add(ident)
            before = old_by_id.get(ident)
            if before == item:
                continue
            changed = True
            row = {"semaphore": where["b_semaphore"], "key": where["b_key"],
                   **{c: getattr(item, c) for c in stmts.columns}}
            (self.inserted if before is None else self.updated).append(row)
        gone = [ident for ident in old_by_id if ident not in new_ids]
        if gone:
            self.deleted.append((where, gone))
        return changed or bool(gone)

    def flush(self, conn: Connection) -> None:
        if self.inserted:
            _insert(conn, self.stmts, self.inserted)
        if _postgres(conn):  # one statement each, whatever the batch (sql.JsonRows)
            if self.updated:
                self.stmts.bulk.update(conn, self.updated)
            if self.deleted:
                self.stmts.bulk.delete(conn, [
                    {"semaphore": where["b_semaphore"], "key": where["b_key"],
                     self.stmts.id_column: ident}
                    for where, ids in self.deleted for ident in ids])
            return
        id_column = self.stmts.id_column
        if self.updated:
            conn.execute(self.stmts.update, [
                {"b_semaphore": row["semaphore"], "b_key": row["key"], "b_id": row[id_column],
                 **{c: row[c] for c in self.stmts.columns if c != id_column}}
                for row in self.updated])
        if self.deleted:
            conn.execute(self.stmts.delete_one,
                         [{**where, "b_id": i} for where, ids in self.deleted for i in ids])


def _insert(conn: Connection, stmts: _Statements, rows: list[dict[str, Any]]) -> None:
    # On PostgreSQL, COPY writes a round's new grants several times faster than an
    # executemany of INSERTs; it runs on the same DBAPI connection, so inside the
    # round's transaction.
    if not _postgres(conn) or len(rows) < _COPY_FROM:
        conn.execute(insert(stmts.table), rows)
        return
    quote = conn.dialect.identifier_preparer.quote
    names = ", ".join(quote(c) for c in stmts.copy_columns)
    statement = f"COPY {quote(stmts.table.name)} ({names}) FROM STDIN"
    dbapi: Any = conn.connection.dbapi_connection
    try:
        with dbapi.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row([row[c] for c in stmts.copy_columns])
    except conn.dialect.loaded_dbapi.Error as exc:
        # Raw DBAPI use bypasses SQLAlchemy: give its errors SQLAlchemy's shape
        # (and drop a dead connection) so callers see one kind of failure.
        if conn.dialect.is_disconnect(exc, dbapi, None):
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(
            statement, None, exc, conn.dialect.loaded_dbapi.Error
        ) from exc


class _ClientWrites:
    """Clients heard from (stamped), new and gone, collected over keys."""

    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []
        self.moved: list[tuple[dict[str, Any], list[str]]] = []
        self.gone: list[dict[str, str]] = []

    def add(self, where: dict[str, str], old: KeyState, new: KeyState) -> bool:
        before = {c.client_id: c.last_seen_at for c in old.clients}
        after = {c.client_id: c.last_seen_at for c in new.clients}
        added = [{"semaphore": where["b_semaphore"], "key": where["b_key"], "client_id": c,
                  "last_seen_at": at} for c, at in after.items() if c not in before]
        # Every client heard in a round gets the same stamp: on SQLite, one update
        # per stamp and key, not one per client.
        moved: dict[float, list[str]] = {}
        for c, at in after.items():
            if c in before and before[c] != at:
                moved.setdefault(at, []).append(c)
        gone = [{**where, "b_id": c} for c in before if c not in after]
        self.added += added
        self.moved += [({**where, "last_seen_at": at}, ids) for at, ids in moved.items()]
        self.gone += gone
        return bool(added or moved or gone)

    def flush(self, conn: Connection) -> None:
        if self.moved and _postgres(conn):  # rows that are there, upserted: see sql.py
            self.added += [{"semaphore": where["b_semaphore"], "key": where["b_key"],
                            "client_id": c, "last_seen_at": where["last_seen_at"]}
                           for where, ids in self.moved for c in ids]
        elif self.moved:
            conn.execute(_TOUCH_CLIENT,
                         [{**where, "b_id": c} for where, ids in self.moved for c in ids])
        if self.added and _postgres(conn):
            _UPSERT_CLIENTS_POSTGRES.execute(conn, self.added)
        elif self.added:
            conn.execute(_UPSERT_CLIENTS_SQLITE, self.added)
        if self.gone and _postgres(conn):
            _UPSERT_CLIENTS_POSTGRES.rows.delete(conn, [
                {"semaphore": row["b_semaphore"], "key": row["b_key"], "client_id": row["b_id"]}
                for row in self.gone])
        elif self.gone:
            conn.execute(_DELETE_CLIENT, self.gone)
