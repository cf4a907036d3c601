# The Celery app the holder tests and the benchmark run: its whole
# configuration comes from one JSON environment variable, so the test process
# and the holder worker subprocess build exactly the same Durability.
from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

from durability_celery import Leases, Strict
from durability_celery.app import Durability
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings

CONFIG_ENV = "DC_HOLDER_TEST_CONFIG"


def make_app(config: dict[str, Any]) -> tuple[Celery, Durability]:
    """config: broker_url, broker_transport_options, shards, semaphores: [{name, database,
    limit, round_wait, round_period, grant_timeout, per_lease (strict leases if set)}],
    settings: {...}."""
    app = Celery("holder_test")
    app.conf.update(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
    )
    semaphores = [
        DurabilitySemaphore(
            s["name"], database=s["database"], limit=s.get("limit", 10),
            round_wait=s.get("round_wait", 0.2), round_period=s.get("round_period", 0.4),
            grant_timeout=s.get("grant_timeout", 10.0),
            leases=(Leases(Strict(), permits_per_lease=s["per_lease"])
                    if "per_lease" in s else None),
        )
        for s in config["semaphores"]
    ]
    settings = DurabilitySettings(**config.get("settings", {}))
    return app, Durability(app, semaphores, settings=settings)


if CONFIG_ENV in os.environ:
    app, durability = make_app(json.loads(os.environ[CONFIG_ENV]))
