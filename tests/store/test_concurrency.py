# Two OS processes, each with its own engine, hammer rounds for ONE key with
# demand far above the limit: the permits really in use (a counter shared by
# both, fed from the responses' grants) and the outstanding permits in the
# table never exceed the limit. The negative test removes the key row lock and
# shows the same harness catches the over-allocation that follows.
from __future__ import annotations

import multiprocessing
import queue
import secrets
from typing import Any

import pytest
import sqlalchemy as sa

from durability_celery import store
from durability_celery.semaphore import DurabilitySemaphore

from .hammer import _outstanding, hammer

LIMIT = 5
PROCESSES = 2


def _run(url: str, *, rounds: int, unlocked: bool = False) -> tuple[list[dict[str, Any]], str]:
    semaphore = f"race-{secrets.token_hex(3)}"
    DurabilitySemaphore.migrate(url)
    ctx = multiprocessing.get_context("spawn")
    running = ctx.Value("i", 0)
    start = ctx.Barrier(PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=hammer, args=(url, semaphore, "acct", LIMIT, w, rounds, running,
                                         start, results, unlocked))
        for w in range(PROCESSES)
    ]
    summaries: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
        for _ in procs:
            summaries.append(results.get(timeout=90))
        for p in procs:
            p.join(10)
    except queue.Empty:
        pytest.fail(f"a hammer process gave no result; got {summaries}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [s["error"] for s in summaries if "error" in s]
    assert errors == [], errors[0] if errors else ""
    return summaries, semaphore


@pytest.mark.timeout(150)
def test_two_processes_never_over_allocate(database_url: str) -> None:
    summaries, semaphore = _run(database_url, rounds=150)
    assert [s["violations"] for s in summaries] == [[], []]
    # The budget was really used up, so an over-allocation had room to show.
    assert max(s["peak"] for s in summaries) == LIMIT
    engine = store.create_engine(database_url)
    try:
        assert _outstanding(engine, semaphore, "acct") <= LIMIT
        with engine.connect() as conn:
            rounds = conn.execute(sa.select(store.keys.c.rounds)
                                  .where(store.keys.c.semaphore == semaphore)).scalar_one()
        assert rounds == (150 + 1) * PROCESSES  # no round was lost to the contention
    finally:
        engine.dispose()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_without_the_row_lock_the_harness_sees_over_allocation(database_url: str) -> None:
    # PostgreSQL only: on SQLite, BEGIN IMMEDIATE serializes rounds even without the row lock.
    # A run usually shows 15-18 violations per process; one CI run of ~20 showed none,
    # for a reason its log did not tell. So up to 3 runs, each summary kept for the message.
    tried: list[list[dict[str, Any]]] = []
    for _ in range(3):
        summaries, _ = _run(database_url, rounds=80, unlocked=True)
        tried.append(summaries)
        if any(s["violations"] for s in summaries):
            return
    pytest.fail(f"removing the key row lock should have let two rounds over-allocate; "
                f"3 runs saw none: {tried}")
