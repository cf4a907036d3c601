# Checks the shared fixtures in conftest.py themselves: the databases are real
# and empty, Redis is flushed, and child processes are really killed.
from __future__ import annotations

import sys

import sqlalchemy as sa
from support import redis_db

REDIS_DB = 10


def test_database_url_is_empty_and_usable(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE leftover (x INTEGER)"))
    finally:
        engine.dispose()


def test_database_url_reset_between_tests(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        assert "leftover" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_redis_url_is_flushed(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    assert redis_url.endswith(f"/{redis_db(REDIS_DB)}")
    assert client.dbsize() == 0
    client.close()


def test_processes_killed_at_stop(processes) -> None:  # type: ignore[no-untyped-def]
    code = "import os,time; os.fork() or time.sleep(60); print('up', flush=True); time.sleep(60)"
    proc = processes.spawn([sys.executable, "-c", code], name="sleeper")
    proc.wait_for_log("up", timeout=10)
    proc.stop(timeout=2)
    assert not proc.group_alive()
