# DurabilitySemaphore over a real database: settings fail at construction
# naming the setting; a round commits before it returns; a bad message or a
# database failure changes nothing; usage, reclaim and deadlines with an
# injected clock. (The allocation rules themselves are tested in tests/core.)
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery import store
from durability_celery.core.config import Leases
from durability_celery.errors import CallerError, ConfigurationError, InfrastructureError
from durability_celery.semaphore import DurabilitySemaphore

from .conftest import FakeClock, SemFactory, fresh_engine, request, table_rows

T0 = 1_764_450_000.0


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"limit": -1}, "limit"),
        ({"limit": "10"}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": lambda: 3}, "limit"),
        ({"group_limit": lambda key: 3}, "group_limit"),
        ({"group_limit": 5}, "group_limit"),
        ({"can_grant": lambda key, group: True}, "can_grant"),
        ({"clock": 5.0}, "clock"),
        ({"round_wait": -1}, "round_wait"),
        ({"round_period": float("nan")}, "round_period"),
        ({"grant_timeout": 0}, "grant_timeout"),
        ({"handoff_window": -1}, "handoff_window"),
        ({"handoff_window": "60"}, "handoff_window"),
        ({"leases": {"permits_per_lease": 4}}, "leases"),
        ({"database": 42}, "database"),
        ({"database": "mysql://localhost/x"}, "database"),
        ({"database": "not a url"}, "database"),
        ({"database": "sqlite://"}, "in-memory"),
        ({"database": "sqlite:///:memory:"}, "in-memory"),
    ],
)
def test_bad_settings_fail_at_construction(tmp_path: Path, options: dict[str, Any],
                                           names: str) -> None:
    settings: dict[str, Any] = {"database": f"sqlite:///{tmp_path / 'x.db'}", "limit": 3}
    settings.update(options)
    with pytest.raises(ConfigurationError, match=names):
        DurabilitySemaphore("accounts", **settings)


def test_bad_name_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="semaphore name"):
        DurabilitySemaphore("", database=f"sqlite:///{tmp_path / 'x.db'}", limit=1)


def test_bad_key_and_messages_are_caller_errors(make_sem: SemFactory) -> None:
    sem = make_sem()
    for key in ("", "k" * 201, None, 5):
        with pytest.raises(CallerError, match="key"):
            sem.run_round(key, [])  # type: ignore[arg-type]
    with pytest.raises(CallerError, match="messages"):
        sem.run_round("k", {"type": "request"})  # type: ignore[arg-type]
    with pytest.raises(CallerError, match="now"):
        sem.run_round("k", [], now=float("inf"))
    assert sem.run_round("k" * 200, []) == []


def test_round_is_committed_before_it_returns(make_sem: SemFactory, database_url: str) -> None:
    sem = make_sem(limit=3)
    [response] = sem.run_round("acct", [request(sem, "acct", "c1", demand=[("wf", 5, T0)])],
                               now=T0 + 1)
    [grant] = response["grants"]
    assert (grant["permits"], grant["status"]) == (3, "active")
    other = fresh_engine(database_url)
    try:
        with other.connect() as conn:
            rows = conn.execute(
                sa.select(store.grants).where(store.grants.c.semaphore == sem.name)
            ).mappings().all()
    finally:
        other.dispose()
    assert [(r["grant_id"], r["client_id"], r["group"], r["permits"], r["claim_deadline"])
            for r in rows] == [(grant["grant_id"], "c1", "wf", 3, T0 + 1 + 10.0)]


def test_invalid_messages_change_nothing(make_sem: SemFactory) -> None:
    sem = make_sem(limit=3)
    [first] = sem.run_round("acct", [request(sem, "acct", "c1", demand=[(None, 2, T0)])],
                            now=T0)
    gid = first["grants"][0]["grant_id"]
    before = table_rows(sem.engine)
    bad = [
        {"type": "request", "v": 2},
        request(sem, "other-key", "c2", demand=[(None, 1, T0)]),
        request(sem, "acct", "c2", grants=[(gid, 2, 2)]),  # c1's grant reported by c2
        {**request(sem, "acct", "c2"), "demand": [{"group": None, "count": -1, "oldest_at": T0}]},
    ]
    responses = sem.run_round("acct", bad, now=T0 + 0.5)
    assert [r["error"]["code"] for r in responses] == ["invalid_message"] * 4
    after = table_rows(sem.engine)
    assert after["durability_semaphore_grants"] == before["durability_semaphore_grants"]
    assert after["durability_semaphore_leases"] == before["durability_semaphore_leases"]


def test_a_bad_message_does_not_spoil_the_round(make_sem: SemFactory) -> None:
    sem = make_sem(limit=3)
    responses = sem.run_round("acct", [
        {"type": "request", "v": 1, "semaphore": sem.name, "key": "acct"},  # no client_id
        request(sem, "acct", "c1", demand=[(None, 2, T0)]),
    ], now=T0)
    assert responses[0]["error"]["message"].startswith("client_id")
    assert [g["permits"] for g in responses[1]["grants"]] == [2]
    assert sem.usage("acct", now=T0).outstanding == 2


def test_usage_reads_the_committed_state(make_sem: SemFactory) -> None:
    sem = make_sem(limit=lambda key: 4, group_limit=lambda key, group: 1 if group == "g" else None)
    sem.run_round("acct", [
        request(sem, "acct", "c1", demand=[("g", 3, T0), (None, 2, T0 + 1)]),
        request(sem, "acct", "c2", demand=[(None, 5, T0 + 2)]),
    ], now=T0 + 3)
    usage = sem.usage("acct", now=T0 + 3)
    assert (usage.limit, usage.outstanding, usage.lease_footprint, usage.grants) == (4, 4, 0, 3)
    assert {(g.group, g.outstanding, g.limit) for g in usage.groups} == {
        ("g", 1, 1), (None, 3, None)}
    assert {(b.group, b.reason, b.queued) for b in usage.blocked} == {
        ("g", "group_limit", 2), (None, "limit", 4)}
    empty = sem.usage("never-seen", now=T0)
    assert (empty.outstanding, empty.grants, empty.limit) == (0, 0, 4)
    assert sem.keys() == ["acct"]  # usage of an unknown key wrote nothing


def test_reclaim_and_deadlines_follow_the_injected_clock(make_sem: SemFactory,
                                                         clock: FakeClock) -> None:
    sem = make_sem(limit=5, grant_timeout=10.0, clock=clock)
    start = clock.now
    [r1] = sem.run_round("a", [request(sem, "a", "c1", demand=[(None, 3, start)])])
    clock.advance(4)
    [r2] = sem.run_round("b", [request(sem, "b", "c1", demand=[(None, 2, start)])])
    assert sem.deadlines() == [("a", start + 10), ("b", start + 14)]
    assert sem.due_deadlines() == []
    assert sem.reclaim("a") == start + 10  # not yet due: unchanged
    # c1 claims one permit of "a" in time; the two others expire.
    gid = r1["grants"][0]["grant_id"]
    sem.run_round("a", [request(sem, "a", "c1", grants=[(gid, 1, 0)])])
    clock.advance(6.5)  # now start + 10.5
    assert sem.due_deadlines() == [("a", start + 10)]
    assert sem.reclaim("a") is None
    assert sem.due_deadlines() == []
    usage = sem.usage("a")
    assert (usage.outstanding, usage.grants) == (1, 1)
    with sem.engine.connect() as conn:
        query = sa.select(store.grants).where(store.grants.c.key == "a")
        row = conn.execute(query).mappings().one()
    assert (row["permits"], row["claimed"], row["status"]) == (1, 1, "expired")
    assert sem.reclaim("never-seen") is None
    assert r2["grants"][0]["permits"] == 2


def test_leases_survive_the_database(make_sem: SemFactory) -> None:
    sem = make_sem(limit=10, leases=Leases(permits_per_lease=4))
    [r1] = sem.run_round("acct", [request(sem, "acct", "c1", demand=[(None, 2, T0)],
                                          supports_leases=True)], now=T0)
    [lease] = r1["leases"]
    assert (lease["permits"], lease["status"]) == (4, "active")
    [r2] = sem.run_round("acct", [request(sem, "acct", "c1", leases=[(lease["lease_id"], 3, 1,
                                                                      False)])], now=T0 + 2)
    [again] = [le for le in r2["leases"] if le["lease_id"] == lease["lease_id"]]
    assert (again["drawn"], again["released"]) == (3, 1)
    usage = sem.usage("acct", now=T0 + 2)
    assert usage.lease_footprint == 3


def test_missing_schema_is_an_infrastructure_error(database_url: str) -> None:
    sem = DurabilitySemaphore("no-schema", database=database_url, limit=1)
    try:
        # still an InfrastructureError (clients ask again), saying what to run
        with pytest.raises(InfrastructureError, match=r"no durability schema .* run "
                           r"`durability-celery migrate`"):
            sem.run_round("k", [])
        with pytest.raises(InfrastructureError):
            sem.usage("k")
    finally:
        sem.close()


def test_unreachable_postgresql_is_an_infrastructure_error() -> None:
    sem = DurabilitySemaphore(
        "nowhere", database="postgresql://postgres@127.0.0.1:5432/dc_store_does_not_exist",
        limit=1,
    )
    try:
        with pytest.raises(InfrastructureError):
            sem.run_round("k", [])
    finally:
        sem.close()


def test_locked_database_fails_the_round_and_changes_nothing(sqlite_url: str) -> None:
    engine = store.create_engine(sqlite_url, busy_timeout=0.2)
    sem = DurabilitySemaphore("locked", database=engine, limit=2)
    sem.migrate()
    sem.run_round("k", [request(sem, "k", "c1", demand=[(None, 1, T0)])], now=T0)
    before = table_rows(engine)
    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database
        with pytest.raises(InfrastructureError, match="locked"):
            sem.run_round("k", [request(sem, "k", "c2", demand=[(None, 1, T0)])], now=T0 + 1)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert table_rows(engine) == before
    sem.close()
    engine.dispose()


def test_a_given_engine_is_shared_and_left_open(database_url: str) -> None:
    engine = store.create_engine(database_url)
    first = DurabilitySemaphore("shared-a", database=engine, limit=1)
    second = DurabilitySemaphore("shared-b", database=engine, limit=2)
    try:
        first.migrate()
        assert first.engine is second.engine is engine
        first.run_round("k", [request(first, "k", "c", demand=[(None, 5, T0)])], now=T0)
        [reply] = second.run_round("k", [request(second, "k", "c", demand=[(None, 5, T0)])],
                                   now=T0)
        assert [g["permits"] for g in reply["grants"]] == [2]  # semaphores are separate
        pool = engine.pool
        first.close()  # not its engine: not disposed (dispose would replace the pool)
        assert engine.pool is pool
        assert second.usage("k", now=T0).outstanding == 2
        assert first.usage("k", now=T0).outstanding == 1
    finally:
        second.close()
        engine.dispose()


def test_ids_are_uuid4_hex_and_a_forked_child_makes_its_own() -> None:
    import multiprocessing
    import uuid

    from durability_celery.semaphore import _new_id

    ids = [_new_id() for _ in range(600)]  # past one read of random bytes
    assert len(set(ids)) == len(ids)
    assert all(uuid.UUID(i).version == 4 and uuid.UUID(i).hex == i for i in ids)
    receiver, sender = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=lambda: sender.send([_new_id() for _ in range(3)]))
    child.start()
    theirs = receiver.recv()
    child.join(10)
    ours = [_new_id() for _ in range(3)]
    assert not set(theirs) & set(ours)
