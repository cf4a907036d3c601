# The gate's consumer step on a worker that consumes no task queue (a holder as
# deployed, on the control queue alone): it starts no timer and consumes no reply
# queue, and has nothing to report at shutdown, until a task reaches its gate
# after all. A fake consumer on kombu's in-memory transport stands in for Celery's.
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Queue

from durability_celery.app import Durability
from durability_celery.worker.step import GateStep

# The module, which `durability_celery.worker.install` (a function) hides.
gate_install = importlib.import_module("durability_celery.worker.install")


class Timer:
    def __init__(self) -> None:
        self.repeated: list[Callable[..., Any]] = []

    def call_repeatedly(self, interval: float, fun: Callable[..., Any],
                        args: tuple[Any, ...] = ()) -> Any:
        self.repeated.append(fun)
        return SimpleNamespace(cancel=lambda: None)


class Consumer:
    """What the gate's step reads of Celery's worker consumer."""

    def __init__(self, app: Celery, queues: list[str]) -> None:
        self.app = app
        self.hostname = "worker@test"
        self.pool = SimpleNamespace(num_processes=2)
        self.timer = Timer()
        self.connection = Connection("memory://")
        self.task_consumer = SimpleNamespace(queues=[Queue(q) for q in queues], channel=None)
        self.soon: list[Callable[[], None]] = []

    def on_task_request(self, request: Any) -> None:
        raise AssertionError("no task is run here")

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.soon.append(callback)

    def run_soon(self) -> None:
        soon, self.soon = self.soon, []
        for callback in soon:
            callback()


@pytest.fixture
def durability() -> Iterator[Durability]:
    app = Celery("idle-gate", set_as_current=False)
    yield Durability(app, [])


def gate_step(durability: Durability, queues: list[str]) -> tuple[GateStep, Consumer]:
    c = Consumer(durability.app, queues)
    step_class = next(s for s in durability.app.steps["consumer"]
                      if isinstance(s, type) and issubclass(s, GateStep))
    return step_class(c), c


def test_on_the_control_queue_alone_the_gate_stays_idle(durability: Durability,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    step, c = gate_step(durability, [durability.control_queue])
    step.start(c)
    assert c.timer.repeated == [] and not step.consumers and not step.began
    reported: list[GateStep] = []
    monkeypatch.setattr(gate_install, "final_report", lambda s, **_: reported.append(s))
    gate_install._final_reports()
    assert step not in reported  # no connection opened to report nothing
    step.stop(c)


def test_a_task_reaching_an_idle_gate_begins_it(durability: Durability) -> None:
    step, c = gate_step(durability, [durability.control_queue])
    step.start(c)
    step.hooks.wake(True)  # as the gate's submit does for a task it holds
    c.run_soon()
    assert step.began and len(c.timer.repeated) == 2
    assert [q.name for consumer in step.consumers for q in consumer.queues] == [
        step.reply_queue.name]
    step.stop(c)


def test_a_worker_with_a_task_queue_begins_its_gate_at_start(durability: Durability) -> None:
    step, c = gate_step(durability, [durability.control_queue, "accounts"])
    step.start(c)
    assert step.began and len(c.timer.repeated) == 2 and step.consumers
    step.stop(c)


@pytest.mark.parametrize("stop", ["stop", "shutdown"])
def test_a_stop_after_celery_dropped_a_lost_connection_is_quiet(durability: Durability,
                                                                stop: str) -> None:
    # A lost broker: Celery drops its connection, then stops (restarts) its steps, and
    # the reply channel's close fails on the dead broker.
    step, c = gate_step(durability, [durability.control_queue, "accounts"])
    step.start(c)
    (consumer,) = step.consumers
    closed: list[bool] = []

    def close() -> None:
        closed.append(True)
        raise ConnectionResetError("the broker is gone")

    consumer.channel.close = close
    c.connection = None
    getattr(step, stop)(c)
    assert closed == [True]
