# The Celery app every benchmark worker runs (holder and client workers), built
# from one JSON environment variable so the driver and the workers agree. Rule:
# every task, admitted or not, records the same ledger line in Redis when it
# ends ("start end published_at", epoch seconds; the fleet tasks add "key group
# worker"): the ledger, not the library, is what the figures are computed from.
from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, current_task

from benchmarks.diy_redis import define_diy_task
from durability_celery import (
    AdmittedTask,
    Durability,
    DurabilitySemaphore,
    DurabilitySettings,
    Leases,
)

CONFIG_ENV = "BENCH_SUITE_CONFIG"


def limit_of(key: str) -> int:
    """Keys are `<limit>:<name>`, so one semaphore serves every limit a benchmark needs."""
    return int(key.split(":", 1)[0])


def group_limit_of(key: str, group: str) -> int | None:
    """Groups named `<ceiling>:<name>` have that ceiling; any other group has none."""
    head, _, rest = group.partition(":")
    return int(head) if rest and head.isdigit() else None


def make_app(config: dict[str, Any]) -> tuple[Celery, Durability]:
    app = Celery("bench_suite")
    app.conf.update(broker_url=config["broker_url"], task_serializer="json",
                    accept_content=["json"], task_ignore_result=True, result_backend=None,
                    worker_prefetch_multiplier=1, worker_hijack_root_logger=True,
                    broker_connection_retry_on_startup=True)
    semaphores = [
        DurabilitySemaphore(name, database=config["database"], limit=limit_of,
                            round_wait=spec["round_wait"], round_period=spec["round_period"],
                            **({"handoff_window": spec["handoff_window"]}
                               if "handoff_window" in spec else {}),
                            leases=Leases() if spec["leases"] else None,
                            group_limit=group_limit_of if spec.get("group_limit") else None)
        for name, spec in config["semaphores"].items()
    ]
    durability = Durability(app, semaphores, settings=DurabilitySettings(
        queue_prefix=config["prefix"], max_held=config.get("max_held")))
    _define_tasks(app, config)
    return app, durability


def _define_tasks(app: Celery, config: dict[str, Any]) -> None:
    ledger = redis.Redis.from_url(config["ledger_url"])

    def body(run: str, work: float, published_at: float, extra: str = "") -> None:
        started = time.time()
        if work:
            time.sleep(work)
        ledger.rpush(f"iv:{run}", f"{started} {time.time()} {published_at}{extra}")

    @app.task(name="bench.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(run: str, account: str, limit: int, work: float, published_at: float) -> None:
        body(run, work, published_at)

    for name in config["semaphores"]:
        _define_admitted(app, name, body)
        _define_fleet(app, name, body)
    _define_fleet(app, None, body)
    define_diy_task(app, counter_url=config["ledger_url"], countdown=config["diy_countdown"],
                    body=body, on_retry=lambda run: ledger.incr(f"retries:{run}"))


def _define_admitted(app: Celery, semaphore: str, body: Any) -> None:
    def admitted(run: str, account: str, limit: int, work: float, published_at: float) -> None:
        body(run, work, published_at)

    app.task(name=f"bench.{semaphore}", base=AdmittedTask, semaphore=semaphore,
             key="account", shared=False)(admitted)


def _define_fleet(app: Celery, semaphore: str | None, body: Any) -> None:
    """`fleet.<semaphore>` (admitted, keyed by account and grouped by group), or
    `fleet.plain` for None: their ledger lines say which key, group and worker ran them,
    which benchmarks/fleets.py needs and the other benchmarks do not pay for."""
    def fleet(run: str, account: str, group: str | None, work: float,
              published_at: float) -> None:
        body(run, work, published_at, f" {account} {group or '-'} {current_task.request.hostname}")

    if semaphore is None:
        app.task(name="fleet.plain", shared=False)(fleet)
    else:
        app.task(name=f"fleet.{semaphore}", base=AdmittedTask, semaphore=semaphore,
                 key="account", group="group", shared=False)(fleet)


if CONFIG_ENV in os.environ:
    app, durability = make_app(json.loads(os.environ[CONFIG_ENV]))
