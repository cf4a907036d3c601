# A client worker stopped while its broker is down cannot send its final report:
# that is one warning line saying so and what becomes of its permits, never a
# traceback. A real gate and client, a real broker URL with nothing listening.
from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from durability_celery.app import Durability
from durability_celery.holder import reply_queue_declaration
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.worker.gate import Gate, Hooks
from durability_celery.worker.plumbing import celery_requests

install = importlib.import_module("durability_celery.worker.install")

pytestmark = pytest.mark.timeout(60)


class Step:
    """What the final report reads of the gate's consumer step."""

    def __init__(self, durability: Durability, gate: Gate) -> None:
        self.durability = durability
        self.gate = gate
        self.client_id = "w1/final"
        self.began = True  # a gate that ran, with reports to send
        self.c = type("Consumer", (), {"app": durability.app})()
        self.reply_queue = reply_queue_declaration("final.reply.w1", expires=60)


def test_a_broker_down_at_shutdown_is_one_warning(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("final", broker="redis://127.0.0.1:1/0", set_as_current=False)
    sem = DurabilitySemaphore("jobs", database=f"sqlite:///{tmp_path / 'd.db'}", limit=1)
    durability = Durability(app, [sem])
    client = durability.semaphore_client("jobs", client_id="w1/final")
    nothing: Any = lambda *_: None  # noqa: E731
    gate = Gate({"jobs": client}, Hooks(handoff=nothing, pool_size=lambda: 1, busy=lambda: 0,
                                        qos_increment=nothing, qos_decrement=nothing,
                                        wake=nothing, requests=celery_requests()),
                max_held=4, hold_deadline=60.0)
    step = Step(durability, gate)
    install.register_step(step)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="durability_celery")
    try:
        install._final_reports()
    finally:
        install._steps.discard(step)
        sem.close()
    records = [r for r in caplog.records if r.name.startswith("durability_celery")]
    assert [r.levelname for r in records] == ["WARNING"], [r.getMessage() for r in records]
    line = records[0].getMessage()
    assert records[0].exc_info is None and "\n" not in line
    assert line.startswith("durability: client w1/final could not send its final report "
                           "(broker unreachable: ")
    assert "grant_timeout" in line and "reconciliation" in line
