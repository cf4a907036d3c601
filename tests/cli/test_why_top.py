# `why` and `top` against a real deployment: a holder and two client workers on
# Redis and PostgreSQL (the gate tests' Cluster), a key with limit 1 running one
# long task while four more wait; and their error lines, which must be one line
# and exit 1. The reason and next-round rules are checked as pure functions.
from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest
from support import redis_db_url

from durability_celery.cli.why import next_round_in, reason_of, since_reply
from tests.cli import test_commands as cli_area
from tests.worker import conftest as worker_area
from tests.worker.conftest import Cluster

pytestmark = pytest.mark.timeout(120)

cli = cli_area.cli
one_line_error = cli_area.one_line_error
cluster_factory = worker_area.cluster_factory
gate_database = worker_area.gate_database

RUN = 30.0
"""Seconds the first task runs: longer than every command below takes (the workers are
killed at the end, not drained)."""


def app_module(folder: Path, text: str) -> str:
    """A Celery module for --app, in `folder` (the command runs there), unique per test."""
    name = f"whyapp_{secrets.token_hex(4)}"
    (folder / f"{name}.py").write_text(text)
    return name


def plain_app(folder: Path, broker: str, database: str) -> str:
    return app_module(folder, (
        "from celery import Celery\n"
        "from durability_celery.app import Durability\n"
        "from durability_celery.semaphore import DurabilitySemaphore\n"
        f"app = Celery('whyapp', broker={broker!r})\n"
        f"Durability(app, [DurabilitySemaphore('jobs', database={database!r}, limit=1)])\n"))


def held_rows(cluster: Cluster) -> list[dict[str, Any]]:
    return [row for reply in cluster.inspect_held().values()
            for row in reply.get("keys", []) if row["held"]]


@pytest.mark.integration
def test_why_and_top_on_a_waiting_key(cluster_factory: Any, processes: Any, cli: Any,
                                      tmp_path: Path) -> None:
    cluster = cluster_factory(limits={"acme": 1})
    cluster.start(clients=2, concurrency=2)
    app = app_module(tmp_path, "from tests.worker.gate_app import make_app\n"
                     f"app, durability = make_app({cluster.config!r})\n")
    (finished,) = cluster.publish(1, key="other", work=0.0)
    cluster.wait_for("a task to finish", lambda: finished in cluster.ends(), timeout=20)
    (running,) = cluster.publish(1, key="acme", work=RUN)
    cluster.wait_for("the long task to start", lambda: running in cluster.starts(), timeout=20)
    waiting = cluster.publish(4, key="acme", work=0.0)
    cluster.wait_for(
        "four tasks held, blocked by the limit",
        lambda: sum(r["held"] for r in held_rows(cluster)) == 4
        and {r["blocked"] for r in held_rows(cluster)} == {"limit"},
        timeout=20, context=lambda: str(held_rows(cluster)))
    try:
        third = waiting[2]
        done = cli("why", third, "-A", app, "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        assert (found["state"], found["semaphore"], found["key"], found["group"]) == (
            "held", cluster.semaphore.name, "acme", None)
        assert found["reason"] == "limit"
        assert found["ahead"] == {"group": 2, "key": 2, "workers": found["ahead"]["workers"]}
        assert (found["limit"], found["in_use"]) == (1, 1)
        # round_period 0.2 + the gathering moment (round_wait 0.05) at the latest
        assert found["next_round_in"] is not None and 0 <= found["next_round_in"] <= 0.25
        reserved = cluster.app.control.inspect(timeout=2).query_task(third) or {}
        assert [node for node, tasks in reserved.items() if tasks] == [found["worker"]]

        text = cli("why", third, "-A", app, cwd=tmp_path)
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith(f"task {third}: held by {found['worker']} for ")
        assert "  reason      limit: the key's limit is reached" in text.stdout
        assert "  ahead       2 of its key and group, 2 of the key" in text.stdout

        run = cli("why", running, "-A", app, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert f"task {running}: running on client-" in run.stdout
        for gone in (finished, "no-such-task"):
            one_line_error(cli("why", gone, "-A", app, cwd=tmp_path),
                           f"task {gone!r} is not held or running on any of the 3 worker(s)")

        top = cli("top", "--once", "-A", app, cwd=tmp_path, env={"COLUMNS": "120"})
        assert top.returncode == 0, top.stderr
        assert f"{cluster.semaphore.name} / acme limit 1" in top.stdout
        assert "running 1/1  held 4" in top.stdout
        assert "holder: in use 1" in top.stdout
        keys = json.loads(cli("top", "--json", "-A", app, cwd=tmp_path).stdout)["keys"]
        assert [(k["account"], k["running"], k["queued"], k["in_use"], k["limit"])
                for k in keys] == [(f"{cluster.semaphore.name} / acme", 1, 4, 1, 1)]
        assert [(g["held"], g["running"], g["blocked"]) for g in keys[0]["groups"]] == [
            (4, 1, "limit")]
    finally:
        sys.modules.pop(app, None)
        for proc in processes.procs:  # not drained: the long task would hold teardown
            proc.kill()


def test_why_and_top_errors_are_one_line(cli: Any, tmp_path: Path, sqlite_url: str) -> None:
    from durability_celery.semaphore import DurabilitySemaphore

    DurabilitySemaphore.migrate(sqlite_url)
    one_line_error(cli("why", "a b"), "not a task id: 'a b'")
    for argv in (("why", "x"), ("top", "--once")):
        one_line_error(cli(*argv, "-A", "no_such_module_xyz"), "cannot import --app")
    down = plain_app(tmp_path, "redis://127.0.0.1:1/0", sqlite_url)
    one_line_error(cli("why", "x", "-A", down, cwd=tmp_path),
                   "broker unreachable (redis://127.0.0.1:1/0)")
    no_db = plain_app(tmp_path, redis_db_url(4), "postgresql://postgres@127.0.0.1:1/none")
    one_line_error(cli("top", "--once", "-A", no_db, cwd=tmp_path), "database unreachable")
    alone = plain_app(tmp_path, redis_db_url(4), sqlite_url)
    one_line_error(cli("why", "x", "-A", alone, "--timeout", "0.2", cwd=tmp_path),
                   "no client worker answered within 0.2 s")
    one_line_error(cli("top", "--limit", "0", "-A", alone, cwd=tmp_path), "--limit must be")


def test_the_reason_a_held_task_gives() -> None:
    # The holder's blocked reason first, then its error, a full pool, a report in flight.
    full = {"blocked": "group_limit", "error": "unavailable: x", "free_slots": 0,
            "waiting_for_reply": 0.1}
    assert reason_of(full) == "group_limit"
    assert reason_of({**full, "blocked": None}) == "holder_error"
    assert reason_of({**full, "blocked": None, "error": None}) == "pool_full"
    assert reason_of({**full, "blocked": None, "error": None, "free_slots": 1}) == (
        "waiting_for_reply")
    assert reason_of({"free_slots": 1, "waiting_for_reply": None}) == "queued"


def test_a_blocked_reason_says_when_permits_came_back_since_the_reply() -> None:
    # The reason is the worker's last reply; the usage is read now.
    assert since_reply("limit", 10, 10, None, 0) == ""
    assert "4 permit(s) came back since" in since_reply("limit", 10, 6, 3, 3)
    assert since_reply("group_limit", 10, 6, 3, 3) == ""
    assert "1 permit(s) came back since" in since_reply("group_limit", 10, 10, 3, 2)
    assert since_reply("limit", None, 0, None, 0) == ""
    assert since_reply("pool_full", 10, 0, None, 0) == ""


def test_next_round_is_at_the_latest_a_period_and_a_gathering_moment_after_the_last() -> None:
    assert next_round_in(None, 2.0, 1.0, now=100.0) is None
    assert next_round_in(100.0, 2.0, 1.0, now=101.0) == pytest.approx(1.1)
    assert next_round_in(100.0, 2.0, 0.05, now=101.0) == pytest.approx(1.05)
    assert next_round_in(100.0, 2.0, 1.0, now=110.0) == 0
