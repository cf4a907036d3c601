# Rows <-> KeyState: every field survives a save and a load in a fresh
# connection, `save` writes only what changed, and the deadline queries.
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from msgspec.structs import replace
from support import reset_postgres

from durability_celery import store
from durability_celery.core.keystate import ClientSeen
from durability_celery.core.round import KeyState
from durability_celery.core.state import Grant, Lease
from durability_celery.wire.reply import Blocked


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = store.create_engine(database_url)
    store.migrate(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def _full_state(semaphore: str = "accounts", key: str = "acct-42") -> KeyState:
    return KeyState(
        semaphore=semaphore,
        key=key,
        grants=(
            Grant("g-1", "celery@a/1", "wf-7", 4, 3, 1, 1764450000.125, 1764450010.125),
            Grant("g-2", "celery@b/2", None, 2, 2, 0, 1764450001.5, 1764450011.5, "expired"),
        ),
        leases=(
            Lease("l-1", "celery@a/1", None, 64, 5, 2, 1764450000.25, 1764450003.75),
            Lease("l-2", "celery@b/2", "wf-7", 8, 8, 3, 1764450002.0, 1764450004.0,
                  status="retired", confirmed=True, issued_limit=10, issued_group_limit=6),
        ),
        last_round_at=1764450005.0625,
        rounds=17,
        limit=10,
        blocked=(Blocked("wf-7", "group_limit", 8), Blocked(None, "limit", 3)),
    )


def _load_fresh(url_engine: sa.Engine, semaphore: str, key: str) -> KeyState:
    # A second engine: proves the data was committed, not just visible to us.
    other = store.create_engine(url_engine.url.render_as_string(hide_password=False))
    try:
        with store.transaction(other, write=True) as conn:
            return store.load(conn, semaphore, key)
    finally:
        other.dispose()


def test_every_field_round_trips(engine: sa.Engine) -> None:
    state = _full_state()
    with store.transaction(engine, write=True) as conn:
        empty = store.load(conn, state.semaphore, state.key)
        assert empty == KeyState(state.semaphore, state.key)
        store.save(conn, empty, state, now=1764450005.5)
    loaded = _load_fresh(engine, state.semaphore, state.key)
    assert loaded == state
    with engine.connect() as conn:
        row = conn.execute(sa.select(store.keys)).mappings().one()
    assert row["next_claim_deadline"] == state.next_claim_deadline == 1764450010.125
    assert row["updated_at"] == 1764450005.5


def test_a_first_round_that_loses_the_race_for_the_key_row_reads_the_winners_state(
        engine: sa.Engine) -> None:
    # Two first rounds of one key: the one that inserts the key row takes the empty
    # state without reading; the other waits (PostgreSQL: on the insert, SQLite: at
    # BEGIN IMMEDIATE) and must then read what the first one committed.
    state = _full_state(key="raced")
    second: dict[str, KeyState] = {}
    other = store.create_engine(engine.url.render_as_string(hide_password=False))
    try:
        with store.transaction(engine, write=True) as conn:
            first = store.load(conn, state.semaphore, state.key)
            assert first == KeyState(state.semaphore, state.key)

            def load_second() -> None:
                with store.transaction(other, write=True) as conn2:
                    second["state"] = store.load(conn2, state.semaphore, state.key)

            racer = threading.Thread(target=load_second)
            racer.start()
            time.sleep(0.3)  # let it reach the row: it waits for this commit
            store.save(conn, first, state, now=1764450005.5)
        racer.join(10)
    finally:
        other.dispose()
    assert second["state"] == state


def test_changes_inserts_and_deletes_round_trip(engine: sa.Engine) -> None:
    state = _full_state()
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, state.semaphore, state.key), state)
    g1, _g2 = state.grants
    l1, _l2 = state.leases
    changed = replace(
        state,
        grants=(g1.report(4, 2),
                Grant("g-3", "celery@c/3", "wf-9", 1, 0, 0, 1764450009.0, 1764450019.0)),
        leases=(l1.report(6, 6, stopped=True, now=1764450009.0),),
        rounds=18, limit=None, blocked=(), last_round_at=1764450009.0,
    )
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, state.semaphore, state.key), changed)
    assert _load_fresh(engine, state.semaphore, state.key) == changed
    with engine.connect() as conn:
        ids = sorted(conn.execute(sa.select(store.grants.c.grant_id)).scalars())
        lease_ids = sorted(conn.execute(sa.select(store.leases.c.lease_id)).scalars())
    assert ids == ["g-1", "g-3"] and lease_ids == ["l-1"]


def _count_statements(engine: sa.Engine) -> list[str]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split()[0].upper())

    sa.event.listen(engine, "before_cursor_execute", record)
    return seen


def test_save_writes_only_what_changed(engine: sa.Engine) -> None:
    state = _full_state()
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, state.semaphore, state.key), state)
    seen = _count_statements(engine)
    with store.transaction(engine, write=True) as conn:
        loaded = store.load(conn, state.semaphore, state.key)
        seen.clear()
        store.save(conn, loaded, loaded)
        assert seen == []  # nothing changed: nothing written
        one_report = replace(loaded, grants=(loaded.grants[0].report(4, 3), loaded.grants[1]))
        store.save(conn, loaded, one_report)
        # That grant, then the key row (on PostgreSQL an upsert: see store.sql).
        key_row = "INSERT" if engine.dialect.name == "postgresql" else "UPDATE"
        assert seen == ["UPDATE", key_row]


def test_states_of_different_keys_and_semaphores_are_separate(engine: sa.Engine) -> None:
    a = _full_state("accounts", "k1")
    # The same ids under another key must not collide (ids are per key).
    b = replace(_full_state("accounts", "k2"), rounds=3)
    c = replace(_full_state("other", "k1"), rounds=4)
    with store.transaction(engine, write=True) as conn:
        for s in (a, b, c):
            store.save(conn, store.load(conn, s.semaphore, s.key), s)
    for s in (a, b, c):
        assert _load_fresh(engine, s.semaphore, s.key) == s
    with store.transaction(engine, write=False) as conn:
        assert store.all_keys(conn) == [("accounts", "k1"), ("accounts", "k2"), ("other", "k1")]
        assert store.all_keys(conn, "other") == [("other", "k1")]
        assert store.read(conn, "accounts", "missing") is None


def test_deadline_queries(engine: sa.Engine) -> None:
    def with_deadline(key: str, deadline: float | None) -> KeyState:
        grants = () if deadline is None else (
            Grant(f"g-{key}", "c", None, 2, 1, 0, deadline - 10, deadline),)
        return KeyState("accounts", key, grants=grants)

    states = [with_deadline("a", 30.0), with_deadline("b", 10.0), with_deadline("c", None),
              with_deadline("d", 20.0)]
    with store.transaction(engine, write=True) as conn:
        for s in states:
            store.save(conn, store.load(conn, s.semaphore, s.key), s)
    with store.transaction(engine, write=False) as conn:
        assert store.deadlines(conn, "accounts") == [("b", 10.0), ("d", 20.0), ("a", 30.0)]
        assert store.deadlines(conn, "accounts", due_by=20.0) == [("b", 10.0), ("d", 20.0)]
        assert store.deadlines(conn, "other") == []


def test_sqlite_runs_in_wal_mode(sqlite_url: str) -> None:
    engine = store.create_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        engine.dispose()


def test_postgresql_url_uses_psycopg(postgres_url: str) -> None:
    plain = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    engine = store.create_engine(plain)
    try:
        assert engine.dialect.driver == "psycopg"
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()


def test_many_rows_round_trip(engine: sa.Engine) -> None:
    # Enough rows for PostgreSQL's COPY path, with every nullable and typed field varied.
    grants = tuple(
        Grant(f"g-{i}", f"c-{i % 3}", None if i % 2 else f"wf-{i}", 5, i % 6, min(i % 6, 2),
              1764450000.0 + i / 7, 1764450010.0 + i / 3, "expired" if i % 4 == 0 else "active")
        for i in range(25)
    )
    leases = tuple(
        Lease(f"l-{i}", f"c-{i % 3}", None if i % 2 else "wf", 64, i, i // 2,
              1764450000.0 + i / 9, 1764450001.0 + i / 11,
              status="retired" if i % 3 == 0 else "active", confirmed=i % 5 == 0,
              issued_limit=i, issued_group_limit=None if i % 2 else i + 1)
        for i in range(25)
    )
    state = KeyState("accounts", "many", grants=grants, leases=leases, rounds=2)
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, "accounts", "many"), state)
    assert _load_fresh(engine, "accounts", "many") == state
    fewer = replace(state, grants=grants[::2], leases=leases[1::2], rounds=3)
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, "accounts", "many"), fewer)
    assert _load_fresh(engine, "accounts", "many") == fewer


@pytest.mark.parametrize("rows", [1, 10])  # INSERT, and COPY on PostgreSQL
def test_a_failed_write_rolls_back_the_whole_round(engine: sa.Engine, rows: int) -> None:
    from durability_celery.errors import InfrastructureError

    existing = KeyState("accounts", "k", grants=tuple(
        Grant(f"g-{i}", "c", None, 1, 0, 0, 1.0, 2.0) for i in range(rows)))
    with store.transaction(engine, write=True) as conn:
        store.save(conn, store.load(conn, "accounts", "k"), existing)
    # A save from a stale `old` that does not know those grants inserts them
    # again: the primary key refuses, and nothing of that transaction stays.
    stale = KeyState("accounts", "k")
    bumped = replace(existing, rounds=5, limit=9)
    with pytest.raises(InfrastructureError), store.transaction(engine, write=True) as conn:
        store.load(conn, "accounts", "k")
        store.save(conn, stale, bumped)
    assert _load_fresh(engine, "accounts", "k") == existing


def _clients_state(key: str, stamp: float, *, limit: int | None) -> KeyState:
    return KeyState("accounts", key, rounds=int(stamp) % 1000, limit=limit,
                    last_round_at=stamp, blocked=(Blocked(None, "limit", 2),) if limit else (),
                    clients=(ClientSeen("celery@a/1", stamp), ClientSeen("celery@b/2", stamp)))


def test_a_batch_writes_its_key_and_client_rows_as_one_statement_each(
        engine: sa.Engine) -> None:
    # On PostgreSQL the rows of a batch go as one JSON text (store.sql.BulkUpsert): inserted,
    # then updated in place, every nullable field both ways.
    keys = [f"k{n}" for n in range(30)]
    first = [_clients_state(k, 1764450000.0, limit=None if n % 2 else n)
             for n, k in enumerate(keys)]
    second = [replace(s, last_round_at=1764450002, rounds=s.rounds + 1,
                      limit=None if s.limit else 7,
                      clients=(ClientSeen("celery@a/1", 1764450002.5),))
              for s in first]
    many: list[str] = []  # statements run as an executemany

    def record(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
               executemany: bool) -> None:
        if executemany:
            many.append(statement.split()[0].upper())

    sa.event.listen(engine, "before_cursor_execute", record)
    for states in (first, second):
        with store.transaction(engine, write=True) as conn:
            loaded = store.load_many(conn, "accounts", keys)
            store.save_many(conn, [(loaded[s.key], s) for s in states])
    for state in second:
        assert _load_fresh(engine, "accounts", state.key) == state
    if engine.dialect.name == "postgresql":
        assert "INSERT" not in many, many  # the gone client's DELETE is one per key


def test_rows_written_as_json_keep_every_character_and_every_float_bit(
        engine: sa.Engine) -> None:
    # store.sql.JsonRows sends a batch's rows as JSON text: quotes, backslashes, control
    # and non-ASCII characters, and floats at full precision, inserted, updated, deleted.
    odd = 'celery@h\u00f6st/"q"\\\t{x}'
    grants = tuple(Grant(f"g{i}-\u00e9\"", odd, "wf,\\1", 3, 1, 0,
                         1764450000.123456789 + i / 3, 1764450010.987654321) for i in range(3))
    first = KeyState("accounts", "k\u2603\"", grants, (), 1764450000.1 + 1e-6, 1, 3,
                     clients=(ClientSeen(odd, 1764450000.000001),))
    second = replace(first, grants=(grants[0].report(3, 2), grants[1]),
                     last_round_at=1764450002.2 + 1e-7, rounds=2)
    for old, new in ((KeyState("accounts", first.key), first), (first, second)):
        with store.transaction(engine, write=True) as conn:
            store.load(conn, "accounts", first.key)
            store.save(conn, old, new)
        assert _load_fresh(engine, "accounts", first.key) == new


def test_a_batch_that_names_a_key_twice_writes_both_in_order(engine: sa.Engine) -> None:
    # One statement may not update a row twice: such a batch goes row by row.
    with store.transaction(engine, write=True) as conn:
        old = store.load(conn, "accounts", "twice")
        store.save_many(conn, [(old, _clients_state("twice", 1764450000.0, limit=3)),
                               (old, _clients_state("twice", 1764450001.0, limit=4))])
    assert _load_fresh(engine, "accounts", "twice") == _clients_state(
        "twice", 1764450001.0, limit=4)


def test_a_batch_locks_its_key_rows_through_the_primary_key_on_a_fresh_table(
        postgres_url: str) -> None:
    # A table never analyzed plans with default estimates: the deadline index, matched
    # on the semaphore alone, once read every key of the semaphore for each key a batch
    # locked (schema version 3 makes it partial, so it cannot serve that lookup).
    reset_postgres(postgres_url)
    engine = store.create_engine(postgres_url)
    try:
        store.migrate(engine)
        keys = [f"k{n:03}" for n in range(200)]
        with store.transaction(engine, write=True) as conn:
            store.load_many(conn, "accounts", keys)  # inserts the rows, not analyzed
        compiled = store.sql._LOCK_KEYS[True].compile(dialect=engine.dialect)
        with engine.connect() as conn:
            plan = "\n".join(row[0] for row in conn.exec_driver_sql(
                f"EXPLAIN {compiled}",
                {**compiled.params, "b_semaphore": "accounts", "b_keys": keys}))
    finally:
        engine.dispose()
    assert "durability_semaphore_keys_pkey" in plan, plan
    assert "keys_deadline" not in plan, plan
