# A Celery app with ONLY beat's reclaim installed (no holder step, no gate), so
# the tests prove that beat alone brings expired grants back. Configured from
# BEAT_TEST_* environment variables set by the test.
from __future__ import annotations

import os
from typing import Any

from celery import Celery

from durability_celery.beat import install
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.wire.routing import control_queue


class FakeDurability:
    """Just the attributes beat.install reads (the real Durability also installs the
    holder and the gate, which these tests keep out on purpose)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


app = Celery("beat_app")
app.conf.update(
    broker_url=os.environ["BEAT_TEST_BROKER"],
    broker_transport_options={
        k[len("BEAT_TEST_OPT_"):].lower(): v
        for k, v in os.environ.items() if k.startswith("BEAT_TEST_OPT_")
    },
    task_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
)
settings = DurabilitySettings(
    reclaim_interval=float(os.environ["BEAT_TEST_INTERVAL"]), queue_prefix="beattest"
)
semaphore = DurabilitySemaphore(
    "beat-sem", database=os.environ["BEAT_TEST_DB"], limit=5, grant_timeout=1.0
)
durability = FakeDurability(
    app=app, settings=settings, semaphores={semaphore.name: semaphore},
    control_queue=control_queue(settings.queue_prefix),
)
install(durability)  # type: ignore[arg-type]
