# Queries over many keys for the holder's timer and beat, and maintenance.
# Rule: like store.sql, no policy: each function runs in the caller's
# transaction and says what it reads or deletes.
from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import delete, select
from sqlalchemy.engine import Connection

from .schema import clients, grants, keys, leases

_DELETE_CHUNK = 500  # keys per DELETE ... IN (...), well under SQLite's variable limit


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
