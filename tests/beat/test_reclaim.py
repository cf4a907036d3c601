# Beat reclamation: the reclaim pass on real databases, the beat entry's routing
# and expiry, and a real `celery beat` + worker (no holder step) reclaiming a
# grant that nobody claims, with no other traffic. Beat's pruning of idle key
# rows, scheduled only when `prune_after` is set.
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from durability_celery.app import Durability
from durability_celery.beat import (
    PRUNE_SCHEDULE_NAME,
    PRUNE_TASK,
    RECLAIM_TASK,
    SCHEDULE_NAME,
    beat_schedule,
    install,
    prune_idle,
    reclaim_due,
)
from durability_celery.errors import ConfigurationError
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from support import filesystem_broker  # noqa: E402


class FakeDurability:
    """Just the attributes beat.install reads (the real Durability also installs the
    holder and the gate, which these tests keep out on purpose)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def request_msg(sem: str, key: str, count: int, *, client: str = "c1") -> dict[str, Any]:
    return {
        "type": "request", "v": 1, "semaphore": sem, "key": key, "client_id": client,
        "demand": [{"group": None, "count": count, "oldest_at": 1.0}],
        "grants": [], "leases": [], "supports_leases": False,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked(database_url: str) -> tuple[DurabilitySemaphore, Clock]:
    clock = Clock()
    sem = DurabilitySemaphore("accounts", database=database_url, limit=5,
                              grant_timeout=10.0, clock=clock)
    sem.migrate()
    yield sem, clock
    sem.close()


def test_reclaims_only_due_keys_and_is_idempotent(clocked: Any) -> None:
    sem, clock = clocked
    sem.run_round("a", [request_msg("accounts", "a", 3)])
    clock.now += 5
    sem.run_round("b", [request_msg("accounts", "b", 2)])
    clock.now += 6  # a's deadline passed (11 s), b's not (6 s)

    summary = reclaim_due([sem])

    assert summary.reclaimed == {"accounts": 1} and summary.failed == {}
    assert sem.state("a").grants == ()
    assert [g.permits for g in sem.state("b").grants] == [2]
    assert reclaim_due([sem]).reclaimed == {"accounts": 0}  # second beat: nothing left
    clock.now += 10
    assert reclaim_due([sem]).reclaimed == {"accounts": 1}
    assert sem.deadlines() == []


def test_claimed_permits_survive_reclaim(clocked: Any) -> None:
    sem, clock = clocked
    [reply] = sem.run_round("a", [request_msg("accounts", "a", 3)])
    grant = reply["grants"][0]
    report = request_msg("accounts", "a", 0)
    report["demand"] = []
    report["grants"] = [{"grant_id": grant["grant_id"], "claimed": 1, "released": 0}]
    sem.run_round("a", [report])
    clock.now += 11
    reclaim_due([sem])
    [left] = sem.state("a").grants
    assert (left.permits, left.claimed) == (1, 1)  # the running task keeps its permit
    assert sem.usage("a").outstanding == 1


def test_a_failing_semaphore_does_not_stop_the_others(clocked: Any, tmp_path: Path) -> None:
    sem, clock = clocked
    broken = DurabilitySemaphore("broken", database=f"sqlite:///{tmp_path / 'none.db'}", limit=1)
    sem.run_round("a", [request_msg("accounts", "a", 1)])
    clock.now += 11
    summary = reclaim_due([broken, sem])  # `broken` has no schema
    assert summary.failed == {"broken": 1}
    assert summary.reclaimed == {"accounts": 1}


def fake_durability(app: Celery, interval: float, sem: DurabilitySemaphore,
                    **more: Any) -> Any:
    settings = DurabilitySettings(reclaim_interval=interval, queue_prefix="dtest", **more)
    return FakeDurability(app=app, settings=settings, semaphores={sem.name: sem},
                           control_queue="dtest.holder.control")


def test_install_schedules_reclaim_on_control_queue_with_expiry(clocked: Any) -> None:
    sem, _ = clocked
    app = Celery("t", broker="memory://", set_as_current=False)
    durability = fake_durability(app, 7.5, sem)
    install(durability)
    app.loader.import_default_modules()
    entry = app.conf.beat_schedule[SCHEDULE_NAME]
    assert entry["task"] == RECLAIM_TASK and entry["schedule"] == 7.5
    assert entry["options"]["queue"] == "dtest.holder.control"
    assert entry["options"]["expires"] == 7.5
    assert beat_schedule(durability)[SCHEDULE_NAME]["options"] == entry["options"]
    # the task body is reclaim_due over the app's semaphores
    assert app.tasks[RECLAIM_TASK]() == {"reclaimed": {"accounts": 0}, "failed": {}}


def test_prune_is_scheduled_only_with_prune_after_and_prunes_idle_keys(clocked: Any) -> None:
    sem, clock = clocked
    [reply] = sem.run_round("done", [request_msg("accounts", "done", 1)])
    report = request_msg("accounts", "done", 0)
    report["demand"] = []
    report["grants"] = [{"grant_id": reply["grants"][0]["grant_id"], "claimed": 1,
                         "released": 1}]
    sem.run_round("done", [report])
    sem.run_round("busy", [request_msg("accounts", "busy", 1)])
    off = Celery("off", broker="memory://", set_as_current=False)
    install(fake_durability(off, 7.5, sem))
    off.loader.import_default_modules()
    assert PRUNE_TASK not in off.tasks and PRUNE_SCHEDULE_NAME not in off.conf.beat_schedule

    app = Celery("t", broker="memory://", set_as_current=False)
    durability = fake_durability(app, 7.5, sem, prune_after=600.0, prune_interval=300.0)
    install(durability)
    app.loader.import_default_modules()
    entry = app.conf.beat_schedule[PRUNE_SCHEDULE_NAME]
    assert entry["task"] == PRUNE_TASK and entry["schedule"] == 300.0
    assert entry["options"] == {"queue": "dtest.holder.control", "expires": 300.0,
                                "ignore_result": True}
    assert beat_schedule(durability)[PRUNE_SCHEDULE_NAME]["options"] == entry["options"]
    assert app.tasks[PRUNE_TASK]() == {"accounts": 0}  # not idle for 600 s yet
    clock.now += 601
    assert app.tasks[PRUNE_TASK]() == {"accounts": 1}
    assert sem.keys() == ["busy"]


def test_a_failing_semaphore_does_not_stop_pruning_the_others(clocked: Any,
                                                              tmp_path: Path) -> None:
    sem, clock = clocked
    broken = DurabilitySemaphore("broken", database=f"sqlite:///{tmp_path / 'none.db'}", limit=1)
    sem.run_round("k", [{**request_msg("accounts", "k", 0), "demand": []}])
    clock.now += 100
    assert prune_idle([broken, sem], 60.0) == {"accounts": 1}  # `broken` has no schema


def test_prune_after_below_a_round_period_is_refused(tmp_path: Path) -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    sem = DurabilitySemaphore("slow", database=f"sqlite:///{tmp_path / 'x.db'}", limit=1,
                              round_period=30.0)
    with pytest.raises(ConfigurationError, match="prune_after"):
        Durability(app, [sem], settings=DurabilitySettings(prune_after=10.0))
    with pytest.raises(ConfigurationError, match="prune_after"):
        DurabilitySettings(prune_after=0)


@pytest.mark.integration
@pytest.mark.redis_db(9)
@pytest.mark.parametrize("backend", ["redis+postgresql", "filesystem+sqlite"])
def test_beat_alone_reclaims_an_unclaimed_grant(
    backend: str, processes: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "redis+postgresql":
        broker_env = {"BEAT_TEST_BROKER": request.getfixturevalue("redis_url")}
        db = request.getfixturevalue("database_url_pg")
    else:
        conf = filesystem_broker(tmp_path)
        broker_env = {"BEAT_TEST_BROKER": conf["broker_url"]}
        broker_env.update({f"BEAT_TEST_OPT_{k.upper()}": str(v)
                           for k, v in conf["broker_transport_options"].items()
                           if k != "polling_interval"})
        db = f"sqlite:///{tmp_path / 'beat.db'}"
    sem = DurabilitySemaphore("beat-sem", database=db, limit=5, grant_timeout=1.0)
    sem.migrate()
    env = {**broker_env, "BEAT_TEST_DB": db, "BEAT_TEST_INTERVAL": "1"}
    worker = processes.start_worker("beat.beat_app", "-Q", "beattest.holder.control",
                                    "--pool=solo", env=env, pythonpath=[HERE.parent])
    processes.start_beat("beat.beat_app", env=env, pythonpath=[HERE.parent])

    [reply] = sem.run_round("k1", [request_msg("beat-sem", "k1", 4)])
    assert reply["grants"][0]["permits"] == 4
    assert sem.deadlines()  # an unclaimed grant is waiting for its deadline

    deadline = time.monotonic() + 20
    while sem.state("k1").grants and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sem.state("k1").grants == (), worker.log()[-3000:]
    assert sem.deadlines() == []
    assert "reclaimed': {'beat-sem': 1}" in worker.log()
    sem.close()


@pytest.fixture
def database_url_pg(postgres_url: str) -> str:
    from support import reset_postgres

    reset_postgres(postgres_url)
    return postgres_url
