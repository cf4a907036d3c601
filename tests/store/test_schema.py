# The schema: migrate creates, is idempotent, records its version, refuses a
# newer database, and `migrate(engine, None)` removes everything; on both backends.
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from durability_celery import store
from durability_celery.errors import ConfigurationError
from durability_celery.semaphore import DurabilitySemaphore

TABLES = {
    "durability_semaphore_grants",
    "durability_semaphore_leases",
    "durability_semaphore_keys",
    "durability_semaphore_clients",
    "durability_semaphore_schema",
}


def _tables(engine: sa.Engine) -> set[str]:
    return {t for t in sa.inspect(engine).get_table_names() if t.startswith("durability_")}


def test_metadata_is_importable_for_alembic() -> None:
    assert set(store.metadata.tables) == TABLES
    grants = store.metadata.tables["durability_semaphore_grants"]
    assert {"semaphore", "key", "grant_id", "client_id", "group", "permits", "claimed",
            "released", "created_at", "claim_deadline", "status"} == set(grants.c.keys())


def test_migrate_creates_is_idempotent_and_drops(database_url: str) -> None:
    engine = store.create_engine(database_url)
    try:
        assert store.migrate(engine) == "created"
        assert _tables(engine) == TABLES
        assert store.migrate(engine) == "current"  # idempotent, and says it changed nothing
        with engine.connect() as conn:
            versions = conn.execute(sa.select(store.schema.schema_version)).all()
        assert [tuple(v) for v in versions] == [(1, store.SCHEMA_VERSION)]
        indexes = {ix["name"] for ix in sa.inspect(engine).get_indexes("durability_semaphore_keys")}
        assert "ix_durability_semaphore_keys_deadline" in indexes
        assert DurabilitySemaphore.migrate(engine, None) == "removed"
        assert _tables(engine) == set()
        assert DurabilitySemaphore.migrate(engine, None) == "absent"  # dropping nothing is fine
    finally:
        engine.dispose()


def test_instance_and_class_forms(database_url: str) -> None:
    sem = DurabilitySemaphore("schema-forms", database=database_url, limit=1)
    try:
        sem.migrate()
        assert _tables(sem.engine) == TABLES
        sem.migrate(None)
        assert _tables(sem.engine) == set()
        DurabilitySemaphore.migrate(database_url)  # a URL works as well as an Engine
        assert _tables(sem.engine) == TABLES
        DurabilitySemaphore.migrate(database_url, None)
        assert _tables(sem.engine) == set()
    finally:
        sem.close()


def _one_lease_at_version(conn: sa.Connection, version: int, *, dropped: tuple[str, ...],
                          acknowledged: bool | None = None) -> None:
    """Take a current schema back to `version` (drop the columns it lacked) and write one
    lease as that version did, on its key's row. `acknowledged` None: no such column."""
    for column in dropped:
        conn.execute(sa.text(f"ALTER TABLE durability_semaphore_leases DROP COLUMN {column}"))
    conn.execute(sa.update(store.schema.schema_version).values(version=version))
    conn.execute(sa.insert(store.keys).values(semaphore="s", key="k", rounds=7,
                                              blocked="[]", last_round_at=1.0))
    row = {"semaphore": "s", "key": "k", "lease_id": "l-1", "client_id": "c", "group": None,
           "permits": 4, "drawn": 1, "released": 0, "issued_at": 1.0, "last_report_at": 1.0,
           "status": "active", "confirmed": False, "issued_limit": 10,
           "issued_group_limit": None}
    if acknowledged is not None:
        row["acknowledged"] = acknowledged
    columns = ", ".join(f'"{name}"' for name in row)
    values = ", ".join(f":{name}" for name in row)
    conn.execute(sa.text(f"INSERT INTO durability_semaphore_leases ({columns})"
                         f" VALUES ({values})"), row)


def test_version_1_is_upgraded_and_its_leases_stay_acknowledged(database_url: str) -> None:
    # Version 1 had no `acknowledged` column and never dropped a lease: its leases
    # come through as acknowledged, so the upgrade drops none of them.
    engine = store.create_engine(database_url)
    try:
        store.migrate(engine, None)
        store.migrate(engine)
        with engine.begin() as conn:
            _one_lease_at_version(conn, 1, dropped=("acknowledged", "issued_round"))
        assert store.migrate(engine) == "upgraded"
        with engine.begin() as conn:
            version = conn.execute(sa.select(store.schema.schema_version.c.version)).scalar()
            (lease,) = store.load(conn, "s", "k").leases
        assert version == store.SCHEMA_VERSION
        assert (lease.lease_id, lease.drawn, lease.acknowledged) == ("l-1", 1, True)
        assert lease.issued_round == 0
    finally:
        store.migrate(engine, None)
        engine.dispose()


def test_version_2_is_upgraded_to_a_partial_deadline_index(database_url: str) -> None:
    # Version 2 indexed every key's deadline, null or not; version 3 only keys with
    # one, which the timer's deadline queries still use (they ask for non-null ones).
    engine = store.create_engine(database_url)
    name = "ix_durability_semaphore_keys_deadline"
    try:
        store.migrate(engine, None)
        store.migrate(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP INDEX {name}"))
            conn.execute(sa.text(f"CREATE INDEX {name} ON durability_semaphore_keys"
                                 " (semaphore, next_claim_deadline)"))
            conn.execute(sa.text("ALTER TABLE durability_semaphore_leases"
                                 " DROP COLUMN issued_round"))
            conn.execute(sa.update(store.schema.schema_version).values(version=2))
            conn.execute(sa.insert(store.keys).values(semaphore="s", key="k", rounds=1,
                                                      blocked="[]", next_claim_deadline=5.0))
        assert store.migrate(engine) == "upgraded"
        with engine.begin() as conn:
            version = conn.execute(sa.select(store.schema.schema_version.c.version)).scalar()
            found = store.deadlines(conn, "s")
        (index,) = [i for i in sa.inspect(engine).get_indexes("durability_semaphore_keys")
                    if i["name"] == name]
        where = index.get("dialect_options", {})
        assert version == store.SCHEMA_VERSION
        assert "next_claim_deadline IS NOT NULL" in str(
            where.get("postgresql_where") or where.get("sqlite_where")), index
        assert found == [("k", 5.0)]
    finally:
        store.migrate(engine, None)
        engine.dispose()


def test_version_3_is_upgraded_and_its_unacknowledged_leases_take_any_report(
        database_url: str) -> None:
    # Version 3 did not record a lease's round: round 0 lets a report from any client
    # acknowledge it, as version 3 did, so an upgrade strands none of them.
    engine = store.create_engine(database_url)
    try:
        store.migrate(engine, None)
        store.migrate(engine)
        with engine.begin() as conn:
            _one_lease_at_version(conn, 3, dropped=("issued_round",), acknowledged=False)
        assert store.migrate(engine) == "upgraded"
        with engine.begin() as conn:
            (lease,) = store.load(conn, "s", "k").leases
        assert (lease.acknowledged, lease.issued_round) == (False, 0)
        assert lease.report(1, 0, stopped=False, now=2.0, seen_round=0).acknowledged
    finally:
        store.migrate(engine, None)
        engine.dispose()


def test_a_holder_refuses_a_database_of_an_older_schema(database_url: str) -> None:
    # Every round would fail on the missing column: the worker says so at start.
    from celery import Celery

    from durability_celery.app import Durability
    from durability_celery.holder.service import Holder

    engine = store.create_engine(database_url)
    sem = DurabilitySemaphore("schema-check", database=engine, limit=1)
    try:
        store.migrate(engine)
        assert store.check_version(engine) == store.SCHEMA_VERSION
        with engine.begin() as conn:
            conn.execute(sa.update(store.schema.schema_version).values(version=1))
        older = f"older than this library's {store.SCHEMA_VERSION}; run"
        with pytest.raises(ConfigurationError, match=older):
            store.check_version(engine)
        holder = Holder(Durability(Celery("schema-check", broker="memory://"), [sem]))
        with pytest.raises(ConfigurationError, match="durability-celery migrate"):
            holder.start()
        store.migrate(engine, None)
        assert store.check_version(engine) is None
    finally:
        sem.close()
        engine.dispose()


def test_newer_schema_and_bad_target_are_refused(database_url: str) -> None:
    engine = store.create_engine(database_url)
    try:
        store.migrate(engine)
        with engine.begin() as conn:
            conn.execute(sa.update(store.schema.schema_version).values(version=99))
        with pytest.raises(ConfigurationError, match="newer"):
            store.migrate(engine)
        with pytest.raises(ConfigurationError, match="target"):
            store.migrate(engine, 7)
    finally:
        engine.dispose()


def test_concurrent_migrations_both_succeed(database_url: str) -> None:
    # Two holders starting at once: the DDL is serialized (advisory lock /
    # BEGIN IMMEDIATE), so neither trips over the other's CREATE TABLE.
    errors: list[BaseException] = []
    engines = [store.create_engine(database_url) for _ in range(2)]
    barrier = threading.Barrier(2)

    def run(engine: sa.Engine) -> None:
        try:
            barrier.wait()
            store.migrate(engine)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert _tables(engines[0]) == TABLES
    finally:
        for e in engines:
            e.dispose()


def test_holders_migrating_one_fresh_sqlite_file_at_once_never_fail(tmp_path: Path) -> None:
    # SQLite refuses a switch to WAL at once, without its busy handler, while another
    # connection holds the file's lock: before the connect hook retried it, about one
    # pair of engines in seven failed here ("database is locked").
    errors: list[BaseException] = []
    for attempt in range(40):
        url = f"sqlite:///{tmp_path / f'fresh{attempt}.db'}"
        engines = [store.create_engine(url) for _ in range(2)]
        barrier = threading.Barrier(2)

        def connect(engine: sa.Engine, barrier: threading.Barrier) -> None:
            try:
                barrier.wait()
                store.migrate(engine)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=connect, args=(e, barrier)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for e in engines:
            e.dispose()
    assert errors == []


def test_rounds_on_a_database_without_the_schema_say_to_migrate(database_url: str) -> None:
    # The holder logs what the round raised: it must say what is wrong and what to run,
    # in one line, not "database error ... relation does not exist".
    from durability_celery.errors import InfrastructureError, SchemaMissing

    sem = DurabilitySemaphore("no-schema", database=database_url, limit=1)
    message = {"type": "request", "v": 1, "semaphore": "no-schema", "key": "k",
               "client_id": "c1", "demand": [{"group": None, "count": 1, "oldest_at": 1.0}],
               "grants": [], "leases": []}
    try:
        for call in (lambda: sem.run_round("k", [message]), lambda: sem.reclaim("k"),
                     sem.deadlines):
            with pytest.raises(SchemaMissing) as raised:
                call()
            text = str(raised.value)
            assert text.startswith("the database has no durability schema (")
            assert text.endswith("): run `durability-celery migrate`")
            assert "durability_semaphore_" in text and "\n" not in text
        sem.migrate()
        assert sem.run_round("k", [message])[0]["grants"]
    finally:
        sem.close()
    down = DurabilitySemaphore("no-schema", database="postgresql://postgres@127.0.0.1:1/x",
                               limit=1)
    try:  # an unreachable database is not mistaken for a missing schema
        with pytest.raises(InfrastructureError) as raised:
            down.deadlines()
        assert not isinstance(raised.value, SchemaMissing)
    finally:
        down.close()
