# Scale-out (docs/operations.md, Scaling holders): two holder processes against one
# PostgreSQL, each serving its own shard range (--durability-shards), split the
# keys; one of them is killed and started again while clients work. No key ever
# has more permits out than its limit, the other holder's keys go on being
# served meanwhile, the restarted holder's keys recover, and every grant comes
# back (usage returns to zero). On the way, the gate's warning about Celery's
# default prefetch comes from a client worker, not from a holder.
from __future__ import annotations

import re
import signal
import threading
import time
from typing import Any

import pytest

from durability_celery.wire.routing import shard_for

from .conftest import Backend, HolderRig, Proc, semaphore_config
from .test_holder import Concurrency, run_workers, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SHARDS, LIMIT = 4, 2
FIRST, SECOND = (0, 1), (2, 3)
PREFETCH_WARNING = r"worker_prefetch_multiplier is 4; admitted tasks need 1"


def keys_of(shards: tuple[int, ...], count: int) -> list[str]:
    found = (f"acct-{n}" for n in range(10_000))
    return [k for k in found if shard_for("jobs", k, SHARDS) in shards][:count]


def the_gate_warns_only_where_admitted_tasks_may_come(rig: HolderRig, holder: Proc) -> None:
    """The app keeps Celery's prefetch multiplier (4), against the gate: a client worker
    says so, a holder consuming the control queue alone (never sent an admitted task)
    does not, and its gate stays idle."""
    tasks = f"{rig.durability.settings.queue_prefix}.tasks"
    client = rig.start_worker("--pool=solo", f"--queues={tasks}", name="client")
    client.wait_for_log(PREFETCH_WARNING, timeout=20)
    client.stop()
    holder.wait_for_log(r"gate idle", timeout=20)
    assert re.search(r"gate started", holder.log()) is None
    assert re.search(PREFETCH_WARNING, holder.log()) is None


def test_two_holders_split_the_shards_and_one_restarts_under_load(
        redis_pg_backend: Backend, make_rig: Any) -> None:
    rig: HolderRig = make_rig(redis_pg_backend, [semaphore_config(
        "jobs", redis_pg_backend.database, limit=LIMIT, round_wait=0.05, round_period=0.2,
        grant_timeout=2.0)], settings={"shards": SHARDS})
    first = rig.start_holder("--durability-shards=0-1", name="holder-a")
    second = rig.start_holder("--durability-shards=2-3", name="holder-b")
    queues = rig.durability.holder_queues
    assert f"consuming {', '.join(queues(FIRST))}\n" in first.log()
    assert f"consuming {', '.join(queues(SECOND))}\n" in second.log()
    the_gate_warns_only_where_admitted_tasks_may_come(rig, first)
    staying, restarted = keys_of(FIRST, 3), keys_of(SECOND, 3)
    pairs = [(rig.client("jobs", timeout=1.0), key) for key in staying + restarted
             for _ in range(LIMIT + 1)]
    result: dict[str, Any] = {}

    def clients() -> None:
        result["seen"], result["errors"] = run_workers(
            pairs, rounds=None, until=time.monotonic() + 20.0, hold=0.02, acquire_timeout=40)

    worker = threading.Thread(target=clients)
    worker.start()
    time.sleep(4.0)
    second.signal(signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(1.0)
    rig.start_holder("--durability-shards=2-3", name="holder-b2")
    back = time.monotonic()
    worker.join(90)
    seen: Concurrency = result["seen"]
    assert result["errors"] == []
    assert max(seen.peak.values()) <= LIMIT, seen.peak
    for key in staying:  # served by the first holder all along
        assert any(killed + 0.5 < t < back for t in seen.times[key]), key
    for key in restarted:  # served before the kill, and again after the restart
        assert any(t < killed for t in seen.times[key]), key
        assert any(t > back for t in seen.times[key]), key
    for client, _ in pairs:
        client.close(timeout=5.0)
    sem = rig.semaphore("jobs")
    # Unclaimed permits of grants whose replies died with holder-b come back at their
    # claim deadline; everything claimed was released and reported.
    for key in staying + restarted:
        assert wait_until(lambda k=key: sem.usage(k).outstanding == 0, timeout=8.0), (
            key, sem.state(key))
