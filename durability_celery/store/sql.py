# Rows <-> KeyState for one round. Rule: this module keeps no policy; `load`
# locks the key row before reading grants and leases, and `save` writes exactly
# the difference the pure core produced, in the caller's transaction, before
# anyone may be answered. Statements are built once, at import: a round only
# binds parameters.
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import sqlalchemy as sa
from sqlalchemy import String, bindparam, delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from ..core.keystate import ClientSeen
from ..core.round import Blocked, KeyState
from ..core.state import Grant, Lease
from .schema import clients, grants, keys, leases

GRANT_COLUMNS = tuple(f.name for f in fields(Grant))
LEASE_COLUMNS = tuple(f.name for f in fields(Lease))
"""Column names are the dataclass field names (one vocabulary), in field order."""

_DELETE_CHUNK = 500  # ids per DELETE ... IN (...) on SQLite, well under its variable limit
_COPY_FROM = 4  # rows from which PostgreSQL inserts use COPY instead of INSERT


def _of_key(table: sa.Table) -> sa.ColumnElement[bool]:
    return sa.and_(table.c.semaphore == bindparam("b_semaphore"),
                   table.c.key == bindparam("b_key"))


class _Statements:
    """The statements of one grant/lease table, built once."""

    def __init__(self, table: sa.Table, id_column: str, columns: tuple[str, ...],
                 order: str) -> None:
        ident = table.c[id_column]
        self.table = table
        self.id_column = id_column
        self.columns = columns
        self.select = (select(*(table.c[c] for c in columns)).where(_of_key(table))
                       .order_by(table.c[order], ident))
        # SET columns come from each parameter set's keys.
        self.update = update(table).where(_of_key(table), ident == bindparam("b_id"))
        self.delete_any = delete(table).where(
            _of_key(table), ident == sa.any_(bindparam("b_ids", type_=postgresql.ARRAY(String))))
        self.delete_in = delete(table).where(
            _of_key(table), ident.in_(bindparam("b_ids", expanding=True)))
        self.copy_columns = [c.name for c in table.columns]


_GRANTS = _Statements(grants, "grant_id", GRANT_COLUMNS, "created_at")
_LEASES = _Statements(leases, "lease_id", LEASE_COLUMNS, "issued_at")
_SELECT_KEY = select(keys.c.last_round_at, keys.c.rounds, keys.c.limit, keys.c.blocked) \
    .where(_of_key(keys))
_SELECT_KEY_LOCKED = _SELECT_KEY.with_for_update()
_UPDATE_KEY = update(keys).where(_of_key(keys))
_SELECT_CLIENTS = (select(clients.c.client_id, clients.c.last_seen_at)
                   .where(_of_key(clients)).order_by(clients.c.client_id))

def _upsert_clients(dialect: Any) -> Any:
    # An upsert, not an insert: a locked round never conflicts, but a stamp must
    # never fail a round (the negative concurrency test runs rounds unlocked).
    stmt = dialect.insert(clients)
    return stmt.on_conflict_do_update(
        index_elements=[clients.c.semaphore, clients.c.key, clients.c.client_id],
        set_={"last_seen_at": stmt.excluded.last_seen_at},
    )


_UPSERT_CLIENTS = {"postgresql": _upsert_clients(postgresql), "sqlite": _upsert_clients(sqlite)}
_TOUCH_CLIENTS_ANY = (update(clients).where(
    _of_key(clients),
    clients.c.client_id == sa.any_(bindparam("b_ids", type_=postgresql.ARRAY(String)))))
_TOUCH_CLIENTS_IN = (update(clients).where(
    _of_key(clients), clients.c.client_id.in_(bindparam("b_ids", expanding=True))))
_DELETE_CLIENT = delete(clients).where(_of_key(clients), clients.c.client_id == bindparam("b_id"))
_NEW_KEY = {"rounds": 0, "blocked": "[]"}


# --- loading ---------------------------------------------------------------


def _insert_key_if_missing(conn: Connection, semaphore: str, key: str) -> bool:
    """Insert the key's row unless it exists; True if this transaction inserted it."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    row = {"semaphore": semaphore, "key": key, **_NEW_KEY}
    result = conn.execute(dialect.insert(keys).values(**row).on_conflict_do_nothing())
    return result.rowcount == 1


def load(conn: Connection, semaphore: str, key: str) -> KeyState:
    """The state of (semaphore, key) for a round: its key row is inserted if missing and
    locked to commit before grants and leases are read, so a concurrent round for the
    same key waits here and then reads what that round committed (or, if `prune_keys`
    deleted the row meanwhile, finds none and starts the key afresh)."""
    state = read(conn, semaphore, key, lock=True)
    for _ in range(3):  # a row pruned between a lost insert and its read: insert again
        if state is not None:
            return state
        # First round of this key. Two first rounds racing both insert; the loser's
        # insert does nothing (PostgreSQL waits for the winner's commit) and it reads
        # what the winner wrote. The winner's row is new and locked by its insert, and
        # nothing refers to a key without a row (rows hang off a key only from its
        # rounds, and prune_keys deletes a row only when none does): its state is the
        # empty one, read or not. Reading it anyway was four statements per first round.
        if _insert_key_if_missing(conn, semaphore, key):
            return KeyState(semaphore=semaphore, key=key)
        state = read(conn, semaphore, key, lock=True)
    if state is None:
        raise RuntimeError(f"the key row of {semaphore}/{key} keeps disappearing")
    return state


def read(conn: Connection, semaphore: str, key: str, *, lock: bool = False) -> KeyState | None:
    """The state of (semaphore, key), or None when it has no key row; never inserts.

    With `lock`, the key row stays locked (FOR UPDATE) until the transaction ends.
    Grants come ordered by (created_at, grant_id), leases by (issued_at, lease_id).
    """
    params = {"b_semaphore": semaphore, "b_key": key}
    row = conn.execute(_SELECT_KEY_LOCKED if lock else _SELECT_KEY, params).first()
    if row is None:
        return None
    last_round_at, rounds, limit, blocked = row
    return KeyState(
        semaphore=semaphore,
        key=key,
        grants=tuple(Grant(*r) for r in conn.execute(_GRANTS.select, params)),
        leases=tuple(Lease(*r) for r in conn.execute(_LEASES.select, params)),
        last_round_at=last_round_at,
        rounds=rounds,
        limit=limit,
        blocked=_blocked_from_json(blocked),
        clients=tuple(ClientSeen(c, at) for c, at in conn.execute(_SELECT_CLIENTS, params)),
    )


def _blocked_from_json(raw: str | None) -> tuple[Blocked, ...]:
    entries = json.loads(raw) if raw else []
    return tuple(Blocked(group=e["group"], reason=e["reason"], queued=e["queued"]) for e in entries)


def _blocked_to_json(blocked: Sequence[Blocked]) -> str:
    return json.dumps([{"group": b.group, "reason": b.reason, "queued": b.queued} for b in blocked])


# --- saving ----------------------------------------------------------------


def _insert(conn: Connection, stmts: _Statements, rows: list[dict[str, Any]]) -> None:
    # On PostgreSQL, COPY writes a round's new grants about five times faster
    # than an executemany of INSERTs (measured: 100 rows 1.6 ms vs 8 ms); it
    # runs on the same DBAPI connection, so inside the round's transaction.
    if conn.dialect.name != "postgresql" or len(rows) < _COPY_FROM:
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


def _delete(conn: Connection, stmts: _Statements, where: dict[str, str], ids: list[str]) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(stmts.delete_any, {**where, "b_ids": ids})
        return
    for start in range(0, len(ids), _DELETE_CHUNK):
        conn.execute(stmts.delete_in, {**where, "b_ids": ids[start:start + _DELETE_CHUNK]})


def _write_diff(conn: Connection, stmts: _Statements, where: dict[str, str],
                old: Sequence[Grant] | Sequence[Lease],
                new: Sequence[Grant] | Sequence[Lease]) -> bool:
    """Insert, update and delete rows of one table by id; True if anything was written."""
    old_by_id = {getattr(item, stmts.id_column): item for item in old}
    new_ids = set()
    inserted: list[dict[str, Any]] = []
    updated: list[dict[str, Any]] = []
    for item in new:
        ident = getattr(item, stmts.id_column)
        new_ids.add(ident)
        before = old_by_id.get(ident)
        if before == item:
            continue
        row = {c: getattr(item, c) for c in stmts.columns}
        if before is None:
            inserted.append({"semaphore": where["b_semaphore"], "key": where["b_key"], **row})
        else:
            del row[stmts.id_column]
            updated.append({**where, "b_id": ident, **row})
    deleted = [ident for ident in old_by_id if ident not in new_ids]
    if inserted:
        _insert(conn, stmts, inserted)
    if updated:
        conn.execute(stmts.update, updated)
    if deleted:
        _delete(conn, stmts, where, deleted)
    return bool(inserted or updated or deleted)


def _write_clients(conn: Connection, where: dict[str, str], old: KeyState,
                   new: KeyState) -> bool:
    before = {c.client_id: c.last_seen_at for c in old.clients}
    after = {c.client_id: c.last_seen_at for c in new.clients}
    added = [{"semaphore": where["b_semaphore"], "key": where["b_key"], "client_id": c,
              "last_seen_at": at} for c, at in after.items() if c not in before]
    # Every client heard in a round gets the same stamp: one UPDATE per stamp,
    # not one per client (each statement is a network exchange).
    moved: dict[float, list[str]] = {}
    for c, at in after.items():
        if c in before and before[c] != at:
            moved.setdefault(at, []).append(c)
    gone = [{**where, "b_id": c} for c in before if c not in after]
    if added:
        conn.execute(_UPSERT_CLIENTS[conn.dialect.name], added)
    touch = _TOUCH_CLIENTS_ANY if conn.dialect.name == "postgresql" else _TOUCH_CLIENTS_IN
    for at, ids in moved.items():
        for start in range(0, len(ids), _DELETE_CHUNK):
            conn.execute(touch, {**where, "b_ids": ids[start:start + _DELETE_CHUNK],
                                 "last_seen_at": at})
    if gone:
        conn.execute(_DELETE_CLIENT, gone)
    return bool(added or moved or gone)


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
    where = {"b_semaphore": new.semaphore, "b_key": new.key}
    changed = _write_diff(conn, _GRANTS, where, old.grants, new.grants)
    changed |= _write_diff(conn, _LEASES, where, old.leases, new.leases)
    changed |= _write_clients(conn, where, old, new)
    row = _key_row(new)
    if changed or row != _key_row(old):
        stamp = now if now is not None else new.last_round_at
        conn.execute(_UPDATE_KEY, {**where, **row, "updated_at": stamp})


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


def _idle_key(idle_before: float) -> sa.ColumnElement[bool]:
    """Untouched since `idle_before`, with no grant, lease or client row hanging off it."""
    def none_in(table: sa.Table) -> sa.ColumnElement[bool]:
        return ~sa.exists().where(table.c.semaphore == keys.c.semaphore,
                                  table.c.key == keys.c.key)

    touched = sa.func.coalesce(keys.c.updated_at, keys.c.last_round_at, 0.0)
    return sa.and_(touched < idle_before, none_in(grants), none_in(leases), none_in(clients))


def prune_keys(conn: Connection, semaphore: str, *, idle_before: float, limit: int) -> int:
    """Delete up to `limit` key rows of `semaphore` that hold nothing and were untouched
    since `idle_before`; returns how many were deleted.

    A key row carries nothing a round needs once the key holds nothing and its last
    round no longer spaces the next: pruned, the key's next round is a first round.
    Rows are locked first, skipping those a round holds (PostgreSQL; on SQLite this
    transaction excludes every round), and the delete checks again with them locked,
    in a statement of its own that sees every commit before it: a round waiting for a
    pruned row then finds none and inserts it again (`load`)."""
    idle = _idle_key(idle_before)
    candidates = (select(keys.c.key).where(keys.c.semaphore == semaphore, idle)
                  .order_by(keys.c.key).limit(limit).with_for_update(skip_locked=True))
    found = [key for (key,) in conn.execute(candidates)]
    deleted = 0
    for start in range(0, len(found), _DELETE_CHUNK):
        chunk = found[start:start + _DELETE_CHUNK]
        deleted += conn.execute(delete(keys).where(
            keys.c.semaphore == semaphore, keys.c.key.in_(chunk), idle)).rowcount
    return deleted


def all_keys(conn: Connection, semaphore: str | None = None) -> list[tuple[str, str]]:
    """Every (semaphore, key) with a key row, optionally for one semaphore."""
    query = select(keys.c.semaphore, keys.c.key).order_by(keys.c.semaphore, keys.c.key)
    if semaphore is not None:
        query = query.where(keys.c.semaphore == semaphore)
    return [(s, k) for s, k in conn.execute(query)]


def silent_clients(conn: Connection, semaphore: str, *,
                   before: float) -> list[tuple[str, str, float]]:
    """(client_id, key, last_seen_at) of clients holding something, unheard since `before`."""
    query = (select(clients.c.client_id, clients.c.key, clients.c.last_seen_at)
             .where(clients.c.semaphore == semaphore, clients.c.last_seen_at < before)
             .order_by(clients.c.client_id, clients.c.key))
    return [(c, k, float(at)) for c, k, at in conn.execute(query)]
