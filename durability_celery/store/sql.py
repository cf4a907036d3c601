# Rows -> KeyState for rounds, one key or a batch of keys in one transaction,
# and the statements store.writes uses to write them back. Rule: this module
# keeps no policy; `load_many` locks the key rows before reading grants and
# leases, in the caller's transaction. A batch reads with one statement per
# table, however many keys it has. Statements are built once, at import: a
# round only binds parameters.
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy import String, bindparam, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from ..core.keystate import ClientSeen
from ..core.round import KeyState
from ..core.state import Grant, Lease
from ..wire.reply import Blocked
from .cache import StateCache
from .schema import clients, grants, keys, leases

GRANT_COLUMNS: tuple[str, ...] = Grant.__struct_fields__
LEASE_COLUMNS: tuple[str, ...] = Lease.__struct_fields__
"""Column names are the struct field names (one vocabulary), in field order."""

_IN_CHUNK = 500  # values per `IN (...)` on SQLite, well under its variable limit
_COPY_FROM = 4  # rows from which PostgreSQL inserts use COPY instead of INSERT
_STRINGS = postgresql.ARRAY(String)


def _of_key(table: sa.Table) -> sa.ColumnElement[bool]:
    return sa.and_(table.c.semaphore == bindparam("b_semaphore"),
                   table.c.key == bindparam("b_key"))


def _of_keys(table: sa.Table) -> sa.ColumnElement[bool]:
    """The rows of a list of keys of one semaphore, on SQLite (`IN`, chunked)."""
    return sa.and_(table.c.semaphore == bindparam("b_semaphore"),
                   table.c.key.in_(bindparam("b_keys", expanding=True)))


def _per_key(query: sa.Select[Any], table: sa.Table, *, lock: bool) -> sa.Select[Any]:
    """`query` over `table`, run for each key of an array on PostgreSQL: a nested loop
    of one primary-key lookup per key, whatever the table's statistics. On a table
    not yet analyzed, `key = ANY(array)` was planned as a scan of the semaphore's every
    row with the keys as a filter, and a lookup per key could take another index
    that matches the semaphore alone: each batch's reads grew with the table. Rows
    come key by key, in the array's order, and are locked in that order with `lock`."""
    wanted = sa.func.unnest(bindparam("b_keys", type_=_STRINGS)) \
        .table_valued("key").render_derived(name="w")
    primary = list(table.primary_key.columns)
    # In primary-key order, which only that index gives without a sort: it wins.
    inner = query.where(table.c.semaphore == bindparam("b_semaphore"),
                        table.c.key == wanted.c.key).order_by(*primary)
    # OFFSET 0 keeps the planner from flattening the subquery into a join of its
    # own choosing (FOR UPDATE does too): the lookup must stay per key.
    found = (inner.with_for_update() if lock else inner.offset(0)).lateral("found")
    return select(*found.c).select_from(wanted).join(found, sa.true())


def _of_many(query: sa.Select[Any], table: sa.Table, postgres: bool, *,
             lock: bool = False) -> sa.Select[Any]:
    if postgres:
        return _per_key(query, table, lock=lock)
    return query.where(_of_keys(table))


Revisions = dict[tuple[Any, ...], str]
"""Revisions of rows written (store.cache), by primary key."""
_POSTGRES = postgresql.dialect()  # type: ignore[no-untyped-call]


class JsonRows:
    """Many rows of `table` written on PostgreSQL as one statement, joined to the table
    through json_to_recordset(the rows as one JSON text) by primary key: the rows are
    bound and sent once, where an executemany binds and sends each row (most of a
    batch's Python time in the store), and encoded by the json module's C encoder, where
    the driver would dump one array per column element by element in Python. The SQL is
    rendered once and run as the driver's own (exec_driver_sql), each field read as its
    column's type. Each row is found through the primary key, as for one row, whatever
    the table's statistics."""

    def __init__(self, table: sa.Table, columns: tuple[str, ...],
                 updates: tuple[str, ...] = (), *, revisions: bool = False) -> None:
        quote = _POSTGRES.identifier_preparer.quote
        self.primary = tuple(c.name for c in table.primary_key.columns)
        self.name = quote(table.name)
        self._types = {c: table.c[c].type.compile(dialect=_POSTGRES) for c in columns}
        self._quote = quote
        names = ", ".join(quote(c) for c in columns)
        self._upsert = (
            f"INSERT INTO {self.name} ({names}) SELECT {names} FROM {self._recordset(columns)}"
            f" ON CONFLICT ({', '.join(quote(c) for c in self.primary)}) DO UPDATE SET "
            + ", ".join(f"{quote(c)} = EXCLUDED.{quote(c)}" for c in updates))
        self._revisions = revisions
        if revisions:
            self._upsert += f" RETURNING {', '.join(quote(c) for c in self.primary)}, xmin::text"
        rest = [c for c in columns if c not in self.primary]
        self._update = (
            f"UPDATE {self.name} SET " + ", ".join(f"{quote(c)} = r.{quote(c)}" for c in rest)
            + f" FROM {self._recordset(columns)} WHERE {self._match()}")
        self._delete = f"DELETE FROM {self.name} USING {self._recordset(self.primary)} " \
                       f"WHERE {self._match()}"

    def _recordset(self, columns: Sequence[str]) -> str:
        fields = ", ".join(f"{self._quote(c)} {self._types[c]}" for c in columns)
        return f"json_to_recordset(CAST(%(rows)s AS json)) AS r({fields})"

    def _match(self) -> str:
        return " AND ".join(f"{self.name}.{self._quote(c)} = r.{self._quote(c)}"
                            for c in self.primary)

    @staticmethod
    def _params(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        # Fields beyond the statement's are ignored by json_to_recordset; a NaN or an
        # infinity, which JSON cannot carry, raises rather than being written.
        return {"rows": json.dumps(rows, allow_nan=False, separators=(",", ":"))}

    def repeats_a_row(self, rows: Sequence[dict[str, Any]]) -> bool:
        """Whether two of `rows` share a primary key: one statement may not write a row twice."""
        return len({tuple(row[c] for c in self.primary) for row in rows}) < len(rows)

    def upsert(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> Revisions:
        """Insert `rows` (dicts with every column of `columns`), or update the `updates`
        columns of those there; no two may share a primary key (repeats_a_row). With
        `revisions`, returns each row's revision (its xmin: store.cache) by primary key."""
        result = conn.exec_driver_sql(self._upsert, self._params(rows))
        return {tuple(row[:-1]): row[-1] for row in result} if self._revisions else {}

    def update(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Set every column of `columns` of the rows there, found by the primary key."""
        conn.exec_driver_sql(self._update, self._params(rows))

    def delete(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Delete the rows whose primary keys `rows` give."""
        conn.exec_driver_sql(self._delete, self._params(rows))


class _Statements:
    """The statements of one grant/lease table, built once."""

    def __init__(self, table: sa.Table, id_column: str, columns: tuple[str, ...],
                 order: str) -> None:
        ident = table.c[id_column]
        self.table = table
        self.id_column = id_column
        self.columns = columns
        self.select = {}
        for postgres in (True, False):
            rows = _of_many(select(table.c.key, *(table.c[c] for c in columns)), table, postgres)
            self.select[postgres] = rows.order_by(rows.selected_columns[order],
                                                  rows.selected_columns[id_column])
        # On SQLite, one row per parameter set; SET columns come from its keys.
        self.update = update(table).where(_of_key(table), ident == bindparam("b_id"))
        self.delete_one = delete(table).where(_of_key(table), ident == bindparam("b_id"))
        self.copy_columns = [c.name for c in table.columns]
        self.bulk = JsonRows(table, ("semaphore", "key", *columns))


_GRANTS = _Statements(grants, "grant_id", GRANT_COLUMNS, "created_at")
_LEASES = _Statements(leases, "lease_id", LEASE_COLUMNS, "issued_at")
_KEY_COLUMNS = (keys.c.key, keys.c.last_round_at, keys.c.rounds, keys.c.limit, keys.c.blocked)
# The row's revision (store.cache): PostgreSQL's xmin, the transaction that last wrote it.
_REVISION: dict[bool, sa.Label[Any]] = {
    True: sa.cast(sa.literal_column(f"{keys.name}.xmin"), sa.Text).label("revision"),
    False: sa.null().label("revision"),
}
_SELECT_KEYS = {postgres: _of_many(select(*_KEY_COLUMNS, _REVISION[postgres]), keys, postgres)
                for postgres in (True, False)}
# Locked in key order (the array's, sorted by load_many), so batches that overlap
# wait for each other instead of deadlocking (on SQLite, BEGIN IMMEDIATE
# serializes rounds).
_LOCK_KEYS = {True: _of_many(select(*_KEY_COLUMNS, _REVISION[True]), keys, True, lock=True),
              False: _SELECT_KEYS[False]}
_UPDATE_KEY = update(keys).where(_of_key(keys))


class BulkUpsert:
    """An upsert of many rows on PostgreSQL as one statement (JsonRows.upsert); rows that
    repeat a primary key go one by one (`single`), as one statement may not update a
    row twice."""

    def __init__(self, table: sa.Table, columns: tuple[str, ...],
                 updates: tuple[str, ...], *, revisions: bool = False) -> None:
        self.rows = JsonRows(table, columns, updates, revisions=revisions)
        single = postgresql.insert(table)
        index = [table.c[c] for c in self.rows.primary]
        self.single = single.on_conflict_do_update(
            index_elements=index, set_={c: single.excluded[c] for c in updates})

    def execute(self, conn: Connection, rows: list[dict[str, Any]]) -> Revisions:
        """Upsert `rows` (dicts with every column of `columns`); the revisions of the rows
        written by one statement (JsonRows.upsert), none for rows written one by one."""
        if self.rows.repeats_a_row(rows):
            conn.execute(self.single, rows)
            return {}
        return self.rows.upsert(conn, rows)


# Key rows are written as an upsert of rows that exist (locked by load_many): one
# statement for a batch, and the conflict is found through the primary key
# whatever the statistics. A plain UPDATE by (semaphore, key), planned on a table
# not yet analyzed, took the deadline index and filtered every key of the semaphore.
_KEY_WRITES = ("last_round_at", "rounds", "limit", "next_claim_deadline", "blocked",
               "updated_at")
_WRITE_KEYS_POSTGRES = BulkUpsert(keys, ("semaphore", "key", *_KEY_WRITES), _KEY_WRITES,
                                   revisions=True)
_DELETE_UNUSED_KEYS = {
    True: delete(keys).where(keys.c.semaphore == bindparam("b_semaphore"), keys.c.rounds == 0,
                             keys.c.key == sa.any_(bindparam("b_keys", type_=_STRINGS))),
    False: delete(keys).where(_of_keys(keys), keys.c.rounds == 0),
}
_SELECT_CLIENTS = {
    postgres: (q := _of_many(select(clients.c.key, clients.c.client_id,
                                    clients.c.last_seen_at), clients, postgres))
    .order_by(q.selected_columns["client_id"])
    for postgres in (True, False)
}
_NEW_KEY = {"rounds": 0, "blocked": "[]"}


def _insert_keys_postgres() -> Any:
    # Inserted in key order too; RETURNING names the rows this transaction made.
    new = sa.func.unnest(bindparam("b_keys", type_=_STRINGS)).column_valued("k")
    rows = select(bindparam("b_semaphore", type_=String), new, sa.literal(0),
                  sa.literal("[]")).order_by(new)
    return (postgresql.insert(keys)
            .from_select(["semaphore", "key", "rounds", "blocked"], rows)
            .on_conflict_do_nothing().returning(keys.c.key))


_INSERT_KEYS_POSTGRES = _insert_keys_postgres()
_INSERT_KEY_SQLITE = sqlite.insert(keys).on_conflict_do_nothing()


def _upsert_clients_sqlite() -> Any:
    # An upsert, not an insert: a locked round never conflicts, but a stamp must
    # never fail a round (the negative concurrency test runs rounds unlocked).
    stmt = sqlite.insert(clients)
    return stmt.on_conflict_do_update(
        index_elements=[clients.c.semaphore, clients.c.key, clients.c.client_id],
        set_={"last_seen_at": stmt.excluded.last_seen_at},
    )


# Also how PostgreSQL stamps clients already there, for the reason of _WRITE_KEYS_POSTGRES.
_UPSERT_CLIENTS_SQLITE = _upsert_clients_sqlite()
_UPSERT_CLIENTS_POSTGRES = BulkUpsert(
    clients, ("semaphore", "key", "client_id", "last_seen_at"), ("last_seen_at",))
_TOUCH_CLIENT = update(clients).where(_of_key(clients), clients.c.client_id == bindparam("b_id"))
_DELETE_CLIENT = delete(clients).where(_of_key(clients), clients.c.client_id == bindparam("b_id"))


def _postgres(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def _chunks(conn: Connection, items: Sequence[str]) -> Iterable[Sequence[str]]:
    """PostgreSQL takes any number of keys as one array; SQLite, chunks of `IN`."""
    if _postgres(conn):
        yield items
        return
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start:start + _IN_CHUNK]


# --- loading ---------------------------------------------------------------


def load(conn: Connection, semaphore: str, key: str) -> KeyState:
    """`load_many` of one key."""
    return load_many(conn, semaphore, [key])[key]


def load_many(conn: Connection, semaphore: str, wanted: Iterable[str], *,
              cache: StateCache | None = None) -> dict[str, KeyState]:
    """The states of `wanted` keys of `semaphore` for one round each: their key rows are
    inserted if missing and locked, all before any grant or lease is read, so a
    concurrent round for one of these keys waits here and then reads what it committed
    (or, if `prune_keys` deleted a row meanwhile, finds none and starts that key
    afresh). One statement per table reads the whole batch. A key whose locked row
    still has the revision `cache` keeps its state under is not read further; when the
    cache knows every key, none is inserted first (a row pruned meanwhile is found
    missing, and inserted then).

    Deadlock-free between batches: every batch first inserts its missing rows in key
    order (an insert waits for another transaction's insert of the same key), then
    locks the other rows in key order, so no two batches wait for each other in a
    circle. Locking existing rows first and inserting after did deadlock."""
    rows: dict[str, tuple[Any, ...]] = {}
    fresh: list[str] = []
    pending = sorted(set(wanted))
    for attempt in range(3):  # a row pruned between a lost insert and its read: insert again
        # Two racing first rounds both insert; the loser's insert does nothing
        # (PostgreSQL waits for the winner's commit) and it reads what the winner
        # wrote. A row this transaction inserted is new and locked by the insert, and
        # nothing refers to a key without a row (rows hang off a key only from its
        # rounds, and prune_keys deletes a row only when none does): its state is the
        # empty one, and reading it would cost statements for nothing.
        known = attempt == 0 and cache is not None and all(map(cache.knows, pending))
        made = set() if known else _insert_keys(conn, semaphore, pending)
        fresh.extend(made)
        rest = [key for key in pending if key not in made]
        found = _key_rows(conn, semaphore, rest, lock=True) if rest else {}
        rows.update(found)
        pending = [key for key in rest if key not in found]
        if not pending:
            break
    if pending:
        raise RuntimeError(f"the key rows of {semaphore}/{pending} keep disappearing")
    states = {key: KeyState(semaphore=semaphore, key=key) for key in fresh}
    if cache is not None:
        for key, row in list(rows.items()):
            kept = cache.get(key, row[-1])
            if kept is not None:
                states[key] = kept
                del rows[key]
    states.update(_states(conn, semaphore, rows))
    return states


def forget_unused_keys(conn: Connection, semaphore: str, unused: Sequence[str]) -> None:
    """Delete the rows of `unused` keys that never had a round saved (rounds 0): those
    `load_many` inserted for rounds that then failed, so a failed first round in a
    batch leaves no row behind, as its own rolled-back transaction would not."""
    for chunk in _chunks(conn, unused):
        conn.execute(_DELETE_UNUSED_KEYS[_postgres(conn)],
                     {"b_semaphore": semaphore, "b_keys": chunk})


def read(conn: Connection, semaphore: str, key: str, *, lock: bool = False) -> KeyState | None:
    """The state of (semaphore, key), or None when it has no key row; never inserts.

    With `lock`, the key row stays locked (FOR UPDATE) until the transaction ends.
    Grants come ordered by (created_at, grant_id), leases by (issued_at, lease_id).
    """
    rows = _key_rows(conn, semaphore, [key], lock=lock)
    return _states(conn, semaphore, rows).get(key)


def _key_rows(conn: Connection, semaphore: str, wanted: Sequence[str], *,
              lock: bool) -> dict[str, tuple[Any, ...]]:
    query = (_LOCK_KEYS if lock else _SELECT_KEYS)[_postgres(conn)]
    found: dict[str, tuple[Any, ...]] = {}
    for chunk in _chunks(conn, wanted):
        for key, *row in conn.execute(query, {"b_semaphore": semaphore, "b_keys": chunk}):
            found[key] = tuple(row)
    return found


def _insert_keys(conn: Connection, semaphore: str, missing: Sequence[str]) -> set[str]:
    """Insert the key rows of `missing` unless they exist; the keys this transaction inserted."""
    if _postgres(conn):
        params = {"b_semaphore": semaphore, "b_keys": list(missing)}
        return {key for (key,) in conn.execute(_INSERT_KEYS_POSTGRES, params)}
    made = set()
    for key in missing:
        row = {"semaphore": semaphore, "key": key, **_NEW_KEY}
        if conn.execute(_INSERT_KEY_SQLITE, row).rowcount == 1:
            made.add(key)
    return made


def _children(conn: Connection, query: dict[bool, Any], semaphore: str,
              wanted: Sequence[str]) -> dict[str, list[Sequence[Any]]]:
    """Rows of one table for `wanted` keys, by key, in the query's order."""
    by_key: dict[str, list[Sequence[Any]]] = {}
    for chunk in _chunks(conn, wanted):
        params = {"b_semaphore": semaphore, "b_keys": chunk}
        for key, *row in conn.execute(query[_postgres(conn)], params):
            by_key.setdefault(key, []).append(row)
    return by_key


def _states(conn: Connection, semaphore: str,
            rows: dict[str, tuple[Any, ...]]) -> dict[str, KeyState]:
    if not rows:
        return {}
    wanted = sorted(rows)
    grant_rows = _children(conn, _GRANTS.select, semaphore, wanted)
    lease_rows = _children(conn, _LEASES.select, semaphore, wanted)
    client_rows = _children(conn, _SELECT_CLIENTS, semaphore, wanted)
    states = {}
    for key, (last_round_at, rounds, limit, blocked, _) in rows.items():
        states[key] = KeyState(
            semaphore=semaphore,
            key=key,
            grants=tuple(Grant(*r) for r in grant_rows.get(key, ())),
            leases=tuple(Lease(*r) for r in lease_rows.get(key, ())),
            last_round_at=last_round_at,
            rounds=rounds,
            limit=limit,
            blocked=_blocked_from_json(blocked),
            clients=tuple(ClientSeen(c, at) for c, at in client_rows.get(key, ())),
        )
    return states


# Written and read for every key of every round; msgspec does both in C.
_BLOCKED_DECODER = msgspec.json.Decoder(tuple[Blocked, ...])
_ENCODER = msgspec.json.Encoder()


def _blocked_from_json(raw: str | None) -> tuple[Blocked, ...]:
    return _BLOCKED_DECODER.decode(raw) if raw else ()


def _blocked_to_json(blocked: Sequence[Blocked]) -> str:
    """A JSON array of {"group", "reason", "queued"} objects."""
    return _ENCODER.encode(blocked).decode()
