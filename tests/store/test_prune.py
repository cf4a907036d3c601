# Pruning idle key rows on each backend: only keys that hold nothing (no grant,
# lease or client row) and had no round for `idle_for` go; a pruned key's next
# round is a first round; bad arguments change nothing; and rounds running at
# the same time are never hurt: a key a round holds is not pruned, and a round
# that waits for a row being pruned starts the key afresh.
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery import store
from durability_celery.core.round import KeyState
from durability_celery.core.state import Grant
from durability_celery.errors import CallerError
from durability_celery.semaphore import DurabilitySemaphore

from .conftest import SemFactory, fresh_engine, request, table_rows

T0 = 1_764_450_000.0


def _grant_ids(reply: dict[str, Any]) -> list[str]:
    return [g["grant_id"] for g in reply["grants"] if g["status"] == "active"]


def _used_and_returned(sem: DurabilitySemaphore, key: str, at: float) -> None:
    """A round that grants one permit, and one that reports it claimed and released."""
    (reply,) = sem.run_round(key, [request(sem, key, "c1", demand=[(None, 1, at)])], now=at)
    (grant,) = _grant_ids(reply)
    sem.run_round(key, [request(sem, key, "c1", grants=[(grant, 1, 1)])], now=at + 3)
    state = sem.state(key)
    assert (state.grants, state.leases, state.clients) == ((), (), ())  # holds nothing


def test_only_keys_that_hold_nothing_and_are_idle_are_pruned(make_sem: SemFactory) -> None:
    sem = make_sem(limit=3)
    _used_and_returned(sem, "idle", T0)
    _used_and_returned(sem, "recent", T0 + 100)
    sem.run_round("holding", [request(sem, "holding", "c2", demand=[(None, 1, T0)])], now=T0)
    assert sem.prune(idle_for=50.0, now=T0 + 110) == 1
    assert sem.keys() == ["holding", "recent"]
    assert [g.permits for g in sem.state("holding").grants] == [1]
    # The pruned key starts again with a first round.
    (reply,) = sem.run_round("idle", [request(sem, "idle", "c1", demand=[(None, 2, T0 + 120)])],
                             now=T0 + 120)
    assert len(_grant_ids(reply)) == 1 and sem.state("idle").rounds == 1
    assert sem.prune(idle_for=50.0, now=T0 + 110) == 0  # nothing idle left


def test_pruning_goes_batch_by_batch(make_sem: SemFactory) -> None:
    sem = make_sem(limit=3)
    for n in range(5):
        _used_and_returned(sem, f"k{n}", T0)
    assert sem.prune(idle_for=60.0, batch=2, now=T0 + 100) == 5
    assert sem.keys() == []


@pytest.mark.parametrize(("options", "problem"), [
    ({"idle_for": 1.0}, "round_period"),  # shorter than the default round_period (2 s)
    ({"idle_for": "3600"}, "idle_for"),
    ({"idle_for": float("nan")}, "idle_for"),
    ({"idle_for": True}, "idle_for"),
    ({"idle_for": 3600.0, "batch": 0}, "batch"),
    ({"idle_for": 3600.0, "batch": 2.5}, "batch"),
])
def test_bad_arguments_are_refused_and_change_nothing(make_sem: SemFactory,
                                                      options: dict[str, Any],
                                                      problem: str) -> None:
    sem = make_sem(limit=3)
    _used_and_returned(sem, "idle", T0)
    before = table_rows(sem.engine)
    with pytest.raises(CallerError, match=problem):
        sem.prune(now=T0 + 10_000, **options)
    assert table_rows(sem.engine) == before


def test_a_key_a_round_holds_is_not_pruned(make_sem: SemFactory, database_url: str) -> None:
    # PostgreSQL skips the locked row at once; SQLite's prune waits for the round's
    # write lock and then finds the key busy. Either way the grant stays.
    sem = make_sem(limit=3)
    _used_and_returned(sem, "k", T0)
    pruned: list[int] = []
    other = fresh_engine(database_url)
    try:
        with store.transaction(sem.engine, write=True) as conn:
            old = store.load(conn, sem.name, "k")
            thread = threading.Thread(target=lambda: pruned.append(_prune(other, sem.name)))
            thread.start()
            time.sleep(0.3)
            grant = Grant("g-kept", "c1", None, 1, 0, 0, T0 + 200, T0 + 210)
            granted = KeyState(sem.name, "k", grants=(grant,), last_round_at=T0 + 200,
                               rounds=old.rounds + 1)
            store.save(conn, old, granted, now=T0 + 200)
        thread.join(10)
    finally:
        other.dispose()
    assert pruned == [0]
    assert [g.grant_id for g in sem.state("k").grants] == ["g-kept"]


def test_a_round_that_waits_for_a_row_being_pruned_starts_the_key_afresh(
        make_sem: SemFactory, database_url: str) -> None:
    sem = make_sem(limit=3)
    _used_and_returned(sem, "k", T0)
    loaded: list[KeyState] = []
    other = fresh_engine(database_url)

    def a_round() -> None:
        with store.transaction(other, write=True) as conn:
            loaded.append(store.load(conn, sem.name, "k"))

    try:
        with store.transaction(sem.engine, write=True) as conn:
            assert store.prune_keys(conn, sem.name, idle_before=T0 + 100, limit=10) == 1
            thread = threading.Thread(target=a_round)
            thread.start()
            time.sleep(0.3)  # it waits for this transaction (the row lock, or SQLite's)
        thread.join(10)
    finally:
        other.dispose()
    assert loaded == [KeyState(sem.name, "k")]  # a first round: rounds 0, no last round
    assert sem.keys() == ["k"]  # its row is back


def _prune(engine: sa.Engine, semaphore: str) -> int:
    with store.transaction(engine, write=True) as conn:
        return store.prune_keys(conn, semaphore, idle_before=T0 + 100, limit=10)

