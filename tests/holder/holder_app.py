# The Celery app the holder tests and the benchmark run: its whole
# configuration comes from one JSON environment variable, so the test process
# and the holder worker subprocess build exactly the same Durability.
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from durability_celery import Leases, Strict
from durability_celery.app import Durability
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings

CONFIG_ENV = "DC_HOLDER_TEST_CONFIG"


def make_app(config: dict[str, Any]) -> tuple[Celery, Durability]:
    """config: broker_url, broker_transport_options, shards, semaphores: [{name, database,
    limit, limit_delay (seconds each key's limit takes to resolve), round_wait,
    round_period, grant_timeout, per_lease (strict leases if set)}], settings: {...}."""
    app = Celery("holder_test")
    app.conf.update(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
    )
    semaphores = [
        DurabilitySemaphore(
            s["name"], database=s["database"], limit=_limit(s.get("limit", 10),
                                                            s.get("limit_delay")),
            round_wait=s.get("round_wait", 0.2), round_period=s.get("round_period", 0.4),
            grant_timeout=s.get("grant_timeout", 10.0),
            leases=(Leases(Strict(), permits_per_lease=s["per_lease"])
                    if "per_lease" in s else None),
        )
        for s in config["semaphores"]
    ]
    settings = DurabilitySettings(**config.get("settings", {}))
    return app, Durability(app, semaphores, settings=settings)


def _limit(limit: int, delay: float | None) -> int | Callable[[str], int]:
    """`limit`, or a callback that takes `delay` to answer it: a holder whose rounds
    cost that much each, whatever the machine (tests of overload)."""
    if delay is None:
        return limit

    def slow(key: str) -> int:
        time.sleep(delay)
        return limit

    return slow


if CONFIG_ENV in os.environ:
    _config = json.loads(os.environ[CONFIG_ENV])
    app, durability = make_app(_config)
