# The state cache (store/cache.py) on PostgreSQL: a round whose key row nobody wrote
# since this process committed it reads that row alone; a write by anyone else (another
# holder, beat's reclaim) or a pruned row is seen, never a stale state; the cache
# forgets what is not used.
from __future__ import annotations

import collections
from typing import Any

import pytest
import sqlalchemy as sa
from support import reset_postgres

from durability_celery.core.keystate import KeyState
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.store.cache import StateCache

from .conftest import FakeClock, SemFactory, request


@pytest.fixture
def database_url(postgres_url: str) -> str:
    """PostgreSQL only: SQLite keeps no cache, its key rows have no revision."""
    reset_postgres(postgres_url)
    return postgres_url


def statements(sem: DurabilitySemaphore) -> collections.Counter[str]:
    """Counts of the statements `sem` runs from now on, by their first word."""
    seen: collections.Counter[str] = collections.Counter()

    @sa.event.listens_for(sem.engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen[statement.split()[0]] += 1

    return seen


def test_a_round_on_a_key_this_process_committed_reads_its_key_row_alone(
        make_sem: SemFactory, clock: FakeClock) -> None:
    sem = make_sem(limit=2, clock=clock)
    [first] = sem.run_round("k", [request(sem, "k", "w1", demand=[(None, 1, clock.now)])])
    [grant] = first["grants"]
    clock.advance(2.0)
    counted = statements(sem)
    [second] = sem.run_round("k", [request(sem, "k", "w1", demand=[(None, 1, clock.now)],
                                           grants=[(grant["grant_id"], 1, 1)])])
    assert counted["SELECT"] == 1  # the key row, locked: no grant, lease or client read
    assert [g["status"] for g in second["grants"]] == ["active", "not_found"]


def test_another_writer_is_seen_through_the_key_rows_revision(
        make_sem: SemFactory, clock: FakeClock) -> None:
    # Two holders on one key (their own caches): what one commits, the other's next
    # round reads, never its own older state.
    name = "shared"
    one, two = make_sem(name=name, limit=1, clock=clock), make_sem(name=name, limit=1, clock=clock)
    [taken] = one.run_round("k", [request(one, "k", "w1", demand=[(None, 1, clock.now)])])
    [grant] = taken["grants"]
    clock.advance(2.0)
    two.run_round("k", [request(two, "k", "w1", grants=[(grant["grant_id"], 1, 1)])])
    clock.advance(2.0)
    [answer] = one.run_round("k", [request(one, "k", "w2", demand=[(None, 1, clock.now)])])
    assert [g["permits"] for g in answer["grants"]] == [1]  # w1's release, seen
    # beat's alarm writes through the store too: a reclaimed grant is seen as well.
    clock.advance(one.config.grant_timeout + 1)
    two.reclaim("k")
    [after] = one.run_round("k", [request(one, "k", "w3", demand=[(None, 1, clock.now)])])
    assert [g["permits"] for g in after["grants"]] == [1]


def test_the_core_runs_before_begin_unless_another_writer_changed_the_key(
        make_sem: SemFactory, clock: FakeClock) -> None:
    # The core asks can_grant for each demand; whether a transaction is open then says
    # where the core ran. A guess made on a state someone else replaced is run again.
    asked_in_transaction: list[bool] = []
    open_now = [False]

    def can_grant(key: str, client_id: str, group: str | None) -> bool:
        asked_in_transaction.append(open_now[0])
        return True

    name = "guessed"
    one = make_sem(name=name, limit=1, clock=clock, can_grant=can_grant)
    two = make_sem(name=name, limit=1, clock=clock)
    sa.event.listen(one.engine, "begin", lambda conn: open_now.__setitem__(0, True))
    for ended in ("commit", "rollback"):
        sa.event.listen(one.engine, ended, lambda conn: open_now.__setitem__(0, False))
    [first] = one.run_round("k", [request(one, "k", "w1", demand=[(None, 1, clock.now)])])
    [grant] = first["grants"]
    clock.advance(2.0)
    one.run_round("k", [request(one, "k", "w1", grants=[(grant["grant_id"], 1, 0)],
                                demand=[(None, 1, clock.now)])])
    assert asked_in_transaction == [False, False]  # a new key, then one it committed
    clock.advance(2.0)
    two.run_round("k", [request(two, "k", "w1", grants=[(grant["grant_id"], 1, 1)])])
    asked_in_transaction.clear()
    [answer] = one.run_round("k", [request(one, "k", "w2", demand=[(None, 1, clock.now)])])
    assert asked_in_transaction == [False, True]  # the guess, then the round on w1's release
    assert [g["permits"] for g in answer["grants"]] == [1]


def test_a_key_pruned_while_cached_starts_afresh(make_sem: SemFactory, clock: FakeClock) -> None:
    sem = make_sem(limit=1, clock=clock)
    sem.run_round("k", [request(sem, "k", "w1")])  # holds nothing afterwards
    clock.advance(sem.config.round_period + 1.0)
    assert sem.prune(idle_for=sem.config.round_period) == 1
    clock.advance(1.0)
    [answer] = sem.run_round("k", [request(sem, "k", "w1", demand=[(None, 1, clock.now)])])
    assert [g["permits"] for g in answer["grants"]] == [1]
    assert sem.state("k").rounds == 1


def test_the_cache_forgets_the_least_recently_used_and_the_idle() -> None:
    now = [0.0]
    cache = StateCache(capacity=2, idle=10.0, clock=lambda: now[0])
    states = {k: KeyState("s", k) for k in "abc"}
    cache.put([("a", "1", states["a"]), ("b", "1", states["b"])])
    assert cache.get("a", "1") == states["a"]  # b is now the least recently used
    assert cache.get("a", "2") is None  # another revision: someone wrote since
    cache.put([("c", "1", states["c"])])
    assert (cache.knows("a"), cache.knows("b"), cache.knows("c")) == (True, False, True)
    now[0] = 11.0
    assert not cache.knows("a")  # unused for `idle`: not trusted to exist any more
    cache.put([("c", "2", states["c"])])
    assert len(cache) == 1
