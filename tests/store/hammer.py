# A child process for the concurrency tests: its own engine and semaphore,
# three simulated clients that claim every permit they are granted at once and
# release some each round, all hammering `run_round` for ONE key. A counter
# shared by every process holds the permits clients are really using (claimed,
# not yet released); since a client only reports a release after it happened,
# that counter can exceed the limit only if the holder over-allocated.
from __future__ import annotations

import random
import time
import traceback
from typing import Any

import sqlalchemy as sa

CLIENTS = 3


def _unlock_rounds(together: Any) -> None:
    """For the negative test: rounds read the key WITHOUT its row lock, and both
    processes read before either writes (`together` is a barrier shared by them),
    so every pair of rounds overlaps however the OS schedules the processes."""
    from durability_celery import store

    def load_unlocked(conn: Any, semaphore: str, key: str) -> Any:
        state = store.read(conn, semaphore, key, lock=False)  # the key row exists already
        together.wait(30)
        return state

    def load_many_unlocked(conn: Any, semaphore: str, keys: Any, **_: Any) -> Any:
        # No cache either: each round reads what the other may have written.
        return {key: load_unlocked(conn, semaphore, key) for key in keys}

    store.load_many = load_many_unlocked  # type: ignore[assignment]


class _Client:
    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.grants: dict[str, list[int]] = {}  # grant_id -> [permits, claimed, released]

    def release_some(self, rng: random.Random) -> int:
        freed = 0
        for grant in self.grants.values():
            if grant[1] > grant[2] and rng.random() < 0.5:
                freed += grant[1] - grant[2]
                grant[2] = grant[1]
        return freed

    def message(self, semaphore: str, key: str, *, sync: bool) -> dict[str, Any]:
        """A request with demand far above the limit, or a sync (reports only)."""
        message: dict[str, Any] = {
            "type": "sync" if sync else "request", "v": 1, "semaphore": semaphore,
            "key": key, "client_id": self.client_id,
            "grants": [{"grant_id": i, "claimed": g[1], "released": g[2]}
                       for i, g in self.grants.items()],
        }
        if not sync:
            message["demand"] = [{"group": None, "count": 1000, "oldest_at": time.time() - 1}]
        return message

    def absorb(self, response: dict[str, Any]) -> int:
        """Claim every permit of new grants at once; returns how many were claimed."""
        claimed = 0
        for grant in response["grants"]:
            gid = grant["grant_id"]
            if grant["status"] == "not_found":
                self.grants.pop(gid, None)
            elif gid not in self.grants and grant["status"] == "active":
                self.grants[gid] = [grant["permits"], grant["permits"], 0]
                claimed += grant["permits"]
        return claimed


def _outstanding(engine: sa.Engine, semaphore: str, key: str) -> int:
    from durability_celery.store import grants

    query = sa.select(sa.func.coalesce(sa.func.sum(grants.c.permits - grants.c.released), 0)) \
        .where(grants.c.semaphore == semaphore, grants.c.key == key)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def hammer(url: str, semaphore: str, key: str, limit: int, worker: int, rounds: int,
           running: Any, start: Any, results: Any, unlocked: bool) -> None:
    """Run `rounds` rounds; put a summary dict (or the traceback) on `results`."""
    try:
        results.put(
            _hammer(url, semaphore, key, limit, worker, rounds, running, start, unlocked)
        )
    except BaseException:
        results.put({"worker": worker, "error": traceback.format_exc()})


def _hammer(url: str, semaphore: str, key: str, limit: int, worker: int, rounds: int,
            running: Any, start: Any, unlocked: bool) -> dict[str, Any]:
    from durability_celery.semaphore import DurabilitySemaphore

    sem = DurabilitySemaphore(semaphore, database=url, limit=limit, grant_timeout=60.0)
    rng = random.Random(worker)
    clients = [_Client(f"w{worker}-c{i}") for i in range(CLIENTS)]
    violations: list[str] = []
    peak = 0
    sem.run_round(key, [])  # connect (and create the key row) before the race starts
    if unlocked:
        _unlock_rounds(start)
    start.wait(60)  # both processes start hammering together
    for n in range(rounds):
        client = clients[n % CLIENTS]
        freed = client.release_some(rng)
        with running.get_lock():  # released locally before the holder hears of it
            running.value -= freed
        # Syncs leave released capacity free until the next round: the moment
        # two unserialized rounds could both hand it out.
        message = client.message(semaphore, key, sync=rng.random() < 0.3)
        [response] = sem.run_round(key, [message])
        claimed = client.absorb(response)
        with running.get_lock():
            running.value += claimed
            now_running = running.value
        peak = max(peak, now_running)
        if now_running > limit:
            violations.append(f"round {n}: {now_running} permits in use > limit {limit}")
        in_table = _outstanding(sem.engine, semaphore, key)
        if in_table > limit:
            violations.append(f"round {n}: {in_table} outstanding in the table > limit {limit}")
    sem.close()
    return {"worker": worker, "rounds": rounds, "peak": peak, "violations": violations}
