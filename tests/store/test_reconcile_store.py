# Forgetting a client confirmed gone, at the store level, on SQLite and
# PostgreSQL: who is silent, what forgetting frees, and that a client heard
# from again in the meantime is never forgotten.
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))

import pytest
import sqlalchemy as sa
from core_harness import KEY, Limits, request, sync

from durability_celery import DurabilitySemaphore, Leases, Strict
from durability_celery.core.clients import SEEN_RESOLUTION
from durability_celery.errors import CallerError

T0 = 10_000.0


def semaphore(url: str) -> DurabilitySemaphore:
    limits = Limits(6)
    sem = DurabilitySemaphore("accounts", database=url, limit=limits.limit,
                              leases=Leases(Strict(), permits_per_lease=2))
    sem.migrate()
    return sem


def hold(sem: DurabilitySemaphore, client: str, now: float) -> dict[str, Any]:
    """A grant and a lease for `client`, whose lease it reports at once as a real client
    does (a lease never reported is dropped at the grant timeout)."""
    (reply,) = sem.run_round(KEY, [request(client, [(None, 2, 1.0)], supports_leases=True)],
                             now=now)
    leases = [(le["lease_id"], 0, 0, False) for le in reply["leases"]]
    sem.run_round(KEY, [sync(client, leases=leases)], now=now + 0.5)
    return reply


def test_silent_clients_are_those_unheard_since(database_url: str) -> None:
    sem = semaphore(database_url)
    hold(sem, "a", T0)
    reply_b = hold(sem, "b", T0)
    gid = reply_b["grants"][0]["grant_id"]
    sem.run_round(KEY, [sync("b", grants=[(gid, 1, 0)])], now=T0 + 50)
    assert sem.silent_clients(silent_for=30, now=T0 + 60) == {"a": [KEY]}
    assert sem.silent_clients(silent_for=70, now=T0 + 60) == {}


def test_forgetting_a_gone_client_frees_its_footprint_only(database_url: str) -> None:
    sem = semaphore(database_url)
    a = hold(sem, "a", T0)
    hold(sem, "b", T0)
    gid = a["grants"][0]["grant_id"]
    sem.run_round(KEY, [sync("a", grants=[(gid, 2, 0)])], now=T0 + 1)  # claimed: never expires
    before = sem.usage(KEY, now=T0 + 100)
    forgotten = sem.forget_client(KEY, "a", silent_for=30, now=T0 + 100)
    assert forgotten is not None
    assert (forgotten.grants, forgotten.leases, forgotten.permits) == (1, 1, 4)
    after = sem.usage(KEY, now=T0 + 100)
    assert after.in_use == before.in_use - 4
    assert "a" not in sem.silent_clients(silent_for=0, now=T0 + 100)
    # If it was not dead after all, its reports find nothing to free again.
    (late,) = sem.run_round(KEY, [sync("a", grants=[(gid, 2, 2)])], now=T0 + 101)
    assert late["grants"][0]["status"] == "not_found"
    assert sem.usage(KEY, now=T0 + 101).in_use == after.in_use


def test_forgetting_a_client_keeps_the_keys_deadline_for_the_others(database_url: str) -> None:
    # b's lease is unacknowledged (dropped at T0 + 60 + grant_timeout 10): after a is
    # forgotten the key must still wake the holder's timer and beat for it.
    sem = semaphore(database_url)
    a = hold(sem, "a", T0)
    gid = a["grants"][0]["grant_id"]
    sem.run_round(KEY, [sync("a", grants=[(gid, 2, 0)])], now=T0 + 1)
    (b,) = sem.run_round(KEY, [request("b", [(None, 1, 1.0)], supports_leases=True)],
                         now=T0 + 60)
    assert [le["acknowledged"] for le in b["leases"]] == [False]
    # b claims its grant (a report that leaves its lease out), so only the lease waits.
    b_grant = b["grants"][0]["grant_id"]
    sem.run_round(KEY, [sync("b", grants=[(b_grant, 1, 0)])], now=T0 + 61)
    assert sem.forget_client(KEY, "a", silent_for=30, now=T0 + 65) is not None
    assert sem.deadlines() == [(KEY, T0 + 70)]
    assert sem.reclaim(KEY, now=T0 + 70) is None
    usage = sem.usage(KEY, now=T0 + 70)
    assert (usage.leases, usage.in_use) == (0, 1)  # b's claimed grant still runs


def test_a_client_heard_from_again_is_not_forgotten(database_url: str) -> None:
    sem = semaphore(database_url)
    hold(sem, "a", T0)
    assert sem.silent_clients(silent_for=30, now=T0 + 60) == {"a": [KEY]}
    sem.run_round(KEY, [sync("a")], now=T0 + 59)  # came back between the scan and the settle
    assert sem.forget_client(KEY, "a", silent_for=30, now=T0 + 60) is None
    assert sem.usage(KEY, now=T0 + 60).leases == 1  # its lease still counts


def test_a_client_heard_again_soon_keeps_its_stamp_and_its_row(database_url: str) -> None:
    """Within SEEN_RESOLUTION a round does not rewrite a client's stamp; after it, it does."""
    sem = semaphore(database_url)
    hold(sem, "a", T0)  # a round and a report 0.5 s apart: one stamp
    assert [(c.client_id, c.last_seen_at) for c in sem.state(KEY).clients] == [("a", T0)]
    writes: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            writes.append(statement)

    sa.event.listen(sem.engine, "before_cursor_execute", record)
    sem.run_round(KEY, [sync("a")], now=T0 + SEEN_RESOLUTION - 0.1)
    assert writes and not [w for w in writes if "durability_semaphore_clients" in w]
    assert sem.state(KEY).clients[0].last_seen_at == T0
    writes.clear()
    sem.run_round(KEY, [sync("a")], now=T0 + SEEN_RESOLUTION)
    assert [w for w in writes if "durability_semaphore_clients" in w]
    assert sem.state(KEY).clients[0].last_seen_at == T0 + SEEN_RESOLUTION


def test_clients_holding_nothing_are_not_tracked(database_url: str) -> None:
    sem = semaphore(database_url)
    reply = hold(sem, "a", T0)
    gid = reply["grants"][0]["grant_id"]
    lid = reply["leases"][0]["lease_id"]
    sem.run_round(KEY, [sync("a", grants=[(gid, 2, 2)], leases=[(lid, 0, 0, True)])],
                  now=T0 + 1)
    assert sem.state(KEY).clients == ()
    assert sem.silent_clients(silent_for=0, now=T0 + 100) == {}


def test_a_round_that_updates_many_leases_writes_every_field(database_url: str) -> None:
    """Regression: a bulk UPDATE once sent NULL columns (a lease's group and group limit)
    untyped to PostgreSQL, failing every round that updated four or more leases."""
    sem = DurabilitySemaphore("accounts", database=database_url, limit=40,
                              leases=Leases(Strict(), permits_per_lease=5))
    sem.migrate()
    clients = [f"c{i}" for i in range(6)]
    replies = sem.run_round(KEY, [request(c, [(None, 1, 1.0)], supports_leases=True)
                                  for c in clients], now=T0)
    lease_ids = [r["leases"][0]["lease_id"] for r in replies]
    sem.run_round(KEY, [sync(c, leases=[(lid, 3, 2, False)])
                        for c, lid in zip(clients, lease_ids, strict=True)], now=T0 + 1)
    leases = sem.state(KEY).leases
    assert len(leases) == 6
    assert {(le.drawn, le.released, le.last_report_at, le.group) for le in leases} == {
        (3, 2, T0 + 1, None)}
    done = sem.run_round(KEY, [sync(c, leases=[(lid, 3, 3, True)])
                               for c, lid in zip(clients, lease_ids, strict=True)], now=T0 + 2)
    assert all(r["leases"][0]["status"] == "settled" for r in done)
    assert sem.usage(KEY, now=T0 + 2).lease_footprint == 0


def test_bad_arguments_are_refused_and_forget_nothing(database_url: str) -> None:
    sem = semaphore(database_url)
    hold(sem, "a", T0)
    for silent_for in ("30", -5, float("nan")):
        with pytest.raises(CallerError, match=r"^silent_for must be a number of seconds"):
            sem.silent_clients(silent_for=silent_for, now=T0 + 60)  # type: ignore[arg-type]
        with pytest.raises(CallerError, match=r"^silent_for must be a number of seconds"):
            sem.forget_client(KEY, "a", silent_for=silent_for,  # type: ignore[arg-type]
                              now=T0 + 60)
    with pytest.raises(CallerError, match=r"^client_id must be a non-empty string"):
        sem.forget_client(KEY, 5, silent_for=30, now=T0 + 60)  # type: ignore[arg-type]
    with pytest.raises(CallerError, match=r"^batch must be a sequence"):
        sem.run_rounds(None, now=T0 + 60)  # type: ignore[arg-type]
    assert sem.usage(KEY, now=T0 + 60).leases == 1  # nothing was forgotten
