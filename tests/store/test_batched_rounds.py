# Rounds of many keys in one transaction (`run_rounds`): each key gets exactly
# the answers and the rows its own `run_round` gives (contended, free and first
# keys, a limit callback that raises, a round that raises: that key fails alone),
# and two holders running overlapping batches on PostgreSQL never over-allocate
# and never deadlock (key rows are locked in key order).
from __future__ import annotations

import itertools
import json
import random
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery import semaphore as semaphore_module
from durability_celery import store
from durability_celery.errors import CallerError
from durability_celery.semaphore import DurabilitySemaphore

from .hammer import _Client, _outstanding

T0 = 1_764_450_000.0
KEYS = ("contended", "free", "broken-limit", "explodes", "quiet")


def _limit(key: str) -> int:
    if key == "broken-limit":
        raise LookupError("no limit for this key")
    return 3


@pytest.fixture
def deterministic_ids(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Grant and lease ids from a counter; calling the result starts it again."""
    counter = itertools.count()

    def restart() -> None:
        nonlocal counter
        counter = itertools.count()

    monkeypatch.setattr(semaphore_module, "_new_id", lambda: f"id-{next(counter)}")
    return restart


@pytest.fixture
def exploding_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure core raises for the key "explodes" (as for a state it cannot take)."""
    real = semaphore_module.run_round

    def run_round(state: Any, *args: Any, **kwargs: Any) -> Any:
        if state.key == "explodes":
            raise ValueError("cannot take this state")
        return real(state, *args, **kwargs)

    monkeypatch.setattr(semaphore_module, "run_round", run_round)


class Clients:
    """Per key, two clients that want 2 permits each and report their grants claimed
    and released in their next request (the quiet key's client only syncs)."""

    def __init__(self) -> None:
        self.grants: dict[tuple[str, str], dict[str, int]] = {}

    def messages(self, name: str, key: str, step: int) -> list[dict[str, Any]]:
        out = []
        for client in ("a", "b") if key != "free" else ("a",):
            held = self.grants.get((key, client), {})
            message: dict[str, Any] = {
                "type": "request", "v": 1, "semaphore": name, "key": key,
                "client_id": f"{key}-{client}", "supports_leases": False,
                "grants": [{"grant_id": g, "claimed": p, "released": p if step % 2 else 0}
                           for g, p in held.items()],
                "demand": [{"group": None, "count": 2, "oldest_at": T0}],
            }
            if key == "quiet":
                message["type"] = "sync"
                del message["demand"]
            out.append(message)
        return out

    def absorb(self, key: str, messages: Sequence[dict[str, Any]],
               responses: Sequence[dict[str, Any]]) -> None:
        for message, response in zip(messages, responses, strict=True):
            client = message["client_id"].rsplit("-", 1)[-1]
            for grant in response.get("grants", ()):
                held = self.grants.setdefault((key, client), {})
                if grant["status"] == "active" and grant["released"] < grant["permits"]:
                    held[grant["grant_id"]] = grant["permits"]
                else:
                    held.pop(grant["grant_id"], None)


def _same(value: Any, name: str) -> str:
    return json.dumps(value, sort_keys=True, default=repr).replace(name, "<sem>")


def _rows(engine: sa.Engine, name: str) -> str:
    tables = (store.keys, store.grants, store.leases, store.clients)
    with engine.connect() as conn:
        rows = {t.name: sorted(tuple(r)[1:] for r in conn.execute(
            sa.select(t).where(t.c.semaphore == name))) for t in tables}
    return _same(rows, name)


def _outcome(result: object) -> object:
    return type(result).__name__ if isinstance(result, Exception) else result


def test_a_batch_gives_each_key_its_own_rounds_answer(
        database_url: str, deterministic_ids: Callable[[], None], exploding_key: None) -> None:
    DurabilitySemaphore.migrate(database_url)
    suffix = secrets.token_hex(3)
    batched = DurabilitySemaphore(f"b-{suffix}", database=database_url, limit=_limit)
    single = DurabilitySemaphore(f"s-{suffix}", database=database_url, limit=_limit)
    clients = Clients()
    try:
        reasons: dict[str, set[str]] = {}
        for step in range(4):
            now = T0 + step * 3.0
            keys = KEYS if step else KEYS[:3]  # later steps add first rounds
            batch = [(k, clients.messages(batched.name, k, step)) for k in keys]
            deterministic_ids()
            together = batched.run_rounds(batch, now=now)
            deterministic_ids()
            alone: list[object] = []
            for k in keys:
                try:
                    alone.append(single.run_round(k, clients.messages(single.name, k, step),
                                                  now=now))
                except Exception as exc:
                    alone.append(exc)
            assert _same([_outcome(r) for r in together], batched.name) == \
                _same([_outcome(r) for r in alone], single.name)
            assert _rows(batched.engine, batched.name) == _rows(single.engine, single.name)
            for (k, messages), result in zip(batch, together, strict=True):
                if not isinstance(result, Exception):
                    clients.absorb(k, messages, result)
                    reasons.setdefault(k, set()).update(
                        b["reason"] for r in result for b in r["blocked"])
        assert isinstance(together[KEYS.index("explodes")], ValueError)
        assert reasons["broken-limit"] == {"limit_resolution_error"}
        assert reasons["contended"] == {"limit"}
    finally:
        batched.close()
        single.close()


def test_bad_items_fail_alone_and_a_batch_of_failures_commits_nothing(
        make_sem: Any, exploding_key: None) -> None:
    sem = make_sem(limit=2)
    results = sem.run_rounds([("ok", []), ("", []), ("ok", []), ("bad", "not a list")],
                             now=T0)
    assert results[0] == []
    assert [type(r) for r in results[1:]] == [CallerError] * 3
    assert sem.run_rounds([], now=T0) == []
    [failed] = sem.run_rounds([("explodes", [])], now=T0)
    assert isinstance(failed, ValueError)
    assert sem.keys() == ["ok"]  # the failed first round's key row was rolled back


def test_messages_are_parsed_before_the_transaction_and_a_parser_failure_fails_alone(
        make_sem: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sem = make_sem(limit=2)
    real = semaphore_module.parse_messages
    connections_out: list[int] = []

    def parse_messages(messages: Any, *, semaphore: str, key: str) -> Any:
        connections_out.append(sem.engine.pool.checkedout())
        if key == "chokes":
            raise RuntimeError("the parser choked")
        return real(messages, semaphore=semaphore, key=key)

    monkeypatch.setattr(semaphore_module, "parse_messages", parse_messages)
    ask = {"type": "request", "v": 1, "semaphore": sem.name, "key": "ok", "client_id": "c",
           "demand": [{"group": None, "count": 1, "oldest_at": T0}]}
    ok, failed = sem.run_rounds([("ok", [ask]), ("chokes", [ask | {"key": "chokes"}])],
                                now=T0)
    assert connections_out == [0, 0]  # no transaction open while parsing
    assert isinstance(ok, list) and ok[0]["grants"][0]["permits"] == 1
    assert isinstance(failed, RuntimeError)
    assert sem.keys() == ["ok"]  # the failed key got no row


@pytest.mark.timeout(120)
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_two_holders_with_overlapping_batches_never_over_allocate_or_deadlock(
        database_url: str) -> None:
    limit, keys, rounds = 3, [f"k{n:02d}" for n in range(12)], 60
    name = f"race-{secrets.token_hex(3)}"
    DurabilitySemaphore.migrate(database_url)
    in_use = dict.fromkeys(keys, 0)
    lock = threading.Lock()
    violations: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def holder(worker: int) -> None:
        sem = DurabilitySemaphore(name, database=database_url, limit=limit, grant_timeout=60.0)
        rng = random.Random(worker)
        clients = {k: _Client(f"w{worker}-{k}") for k in keys}
        try:
            start.wait(30)
            for _ in range(rounds):
                batch = rng.sample(keys, 8)  # overlapping, in a different order each time
                messages = []
                for k in batch:
                    freed = clients[k].release_some(rng)
                    with lock:
                        in_use[k] -= freed
                    messages.append((k, [clients[k].message(name, k, sync=rng.random() < 0.3)]))
                for (k, _), result in zip(messages, sem.run_rounds(messages), strict=True):
                    assert not isinstance(result, Exception), result
                    claimed = clients[k].absorb(result[0])
                    with lock:
                        in_use[k] += claimed
                        if in_use[k] > limit:
                            violations.append(f"{k}: {in_use[k]} in use > {limit}")
        except BaseException as exc:  # a deadlock arrives here as InfrastructureError
            errors.append(exc)
        finally:
            sem.close()

    threads = [threading.Thread(target=holder, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and violations == []
    engine = store.create_engine(database_url)
    try:
        assert all(_outstanding(engine, name, k) <= limit for k in keys)
    finally:
        engine.dispose()



@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_pooled_connection_killed_between_rounds_is_replaced_without_a_failure(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # What pool_pre_ping caught with a SELECT 1 before every round: a database
    # restart leaves the pool's connections dead. The round now runs again, once.
    DurabilitySemaphore.migrate(database_url)
    sem = DurabilitySemaphore(f"s-{secrets.token_hex(3)}", database=database_url, limit=2)
    killer = store.create_engine(database_url)
    try:
        assert sem.run_rounds([("a", []), ("b", [])], now=T0) == [[], []]
        with killer.connect() as conn:
            killed = conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar()
        assert killed >= 1
        with caplog.at_level("WARNING", logger="durability_celery.store"):
            assert sem.run_rounds([("a", []), ("c", [])], now=T0 + 1) == [[], []]
        assert "connection lost" in caplog.text
        assert sem.state("a").rounds == 2 and sem.state("c").rounds == 1
    finally:
        killer.dispose()
        sem.close()


def _group_limit(key: str, group: str) -> int | None:
    return {"narrow": 1, "wide": None}.get(group, 2)


def _can_grant(key: str, client_id: str, group: str | None) -> bool:
    return not (key == "k3" and client_id.endswith("-c2"))


def _random_messages(rng: random.Random, name: str, key: str, held: dict[str, dict[str, int]],
                     now: float) -> list[dict[str, Any]]:
    """One to three clients' requests or syncs, reporting some of their grants."""
    out = []
    for client in rng.sample([f"{key}-c{n}" for n in range(3)], rng.randint(1, 3)):
        grants = held.setdefault(client, {})
        reports = []
        for gid, permits in list(grants.items()):
            if rng.random() < 0.6:
                claimed = rng.randint(0, permits)
                released = rng.randint(0, claimed)
                reports.append({"grant_id": gid, "claimed": claimed, "released": released})
        message: dict[str, Any] = {"type": "request", "v": 1, "semaphore": name, "key": key,
                                   "client_id": client, "grants": reports}
        if rng.random() < 0.25:
            message["type"] = "sync"
        else:
            message["demand"] = [{"group": g, "count": rng.randint(0, 4), "oldest_at": now - 1}
                                 for g in rng.sample([None, "narrow", "wide"], rng.randint(1, 2))]
        out.append(message)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_key_by_key_rounds(
        database_url: str, deterministic_ids: Callable[[], None], seed: int) -> None:
    DurabilitySemaphore.migrate(database_url)
    rng = random.Random(seed)
    suffix = secrets.token_hex(3)
    options: dict[str, Any] = {"limit": lambda key: 1 + int(key[1:]) % 4,
                               "group_limit": _group_limit, "can_grant": _can_grant,
                               "grant_timeout": 5.0}
    batched = DurabilitySemaphore(f"b-{suffix}", database=database_url, **options)
    single = DurabilitySemaphore(f"s-{suffix}", database=database_url, **options)
    held: dict[str, dict[str, dict[str, int]]] = {}
    try:
        for step in range(8):
            now = T0 + step * rng.choice([0.5, 3.0, 7.0])  # some grants expire unclaimed
            keys = rng.sample([f"k{n}" for n in range(6)], rng.randint(1, 6))
            batch = [(k, _random_messages(rng, batched.name, k, held.setdefault(k, {}), now))
                     for k in keys]
            deterministic_ids()
            together = batched.run_rounds(batch, now=now)
            deterministic_ids()
            alone = [single.run_round(k, json.loads(_same(m, batched.name).replace(
                "<sem>", single.name)), now=now) for k, m in batch]
            assert _same(together, batched.name) == _same(alone, single.name)
            assert _rows(batched.engine, batched.name) == _rows(single.engine, single.name)
            for (k, messages), responses in zip(batch, together, strict=True):
                for message, response in zip(messages, responses, strict=True):
                    assert not isinstance(response, Exception)
                    grants = held[k].setdefault(message["client_id"], {})
                    for grant in response.get("grants", ()):
                        if grant["status"] == "active":
                            grants[grant["grant_id"]] = grant["permits"]
                        else:
                            grants.pop(grant["grant_id"], None)
    finally:
        batched.close()
        single.close()
