# What the gate tells its metrics: each admission once, with its permit's source
# and how long it was held (0 when a permit was at hand), and a holder that
# leaves a key unanswered once while it stays silent. Pure: fake hooks, requests and clock,
# real series.
from __future__ import annotations

import dataclasses

import pytest

from durability_celery.metrics import Metrics
from durability_celery.worker.gate import Gate

from .gate_fakes import FakeRequest, Loop
from .helpers import SEM, FakeClock, grant, make_client, reply

pytestmark = pytest.mark.timeout(30)


def counted_gate() -> tuple[Gate, Metrics, FakeClock]:
    clock = FakeClock()
    metrics = Metrics()
    counted = metrics.worker()
    hooks = dataclasses.replace(Loop(4).hooks(), admitted=counted.admitted,
                                unanswered=counted.no_answer)
    client = make_client(clock, handoff_window=60.0, handoff_linger=1.0)
    client.capacity = 4
    return Gate({SEM: client}, hooks, max_held=8, hold_deadline=600.0, clock=clock), \
        metrics, clock


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"semaphore": SEM, **labels})


def test_admissions_count_with_their_hold_time() -> None:
    gate, metrics, clock = counted_gate()
    gate.submit(FakeRequest())
    (message,) = gate.pump()
    clock.advance(3)
    assert gate.on_reply(message.correlation_id, reply(clock.now, grants=[
        grant("g", permits=2, claim_deadline=clock.now + 10)]))
    # The held task starts as the next arrives, which the second permit starts at once.
    gate.submit(FakeRequest())
    assert len(gate.state.running) == 2
    assert sample(metrics, "durability_worker_admissions_total", source="grant") == 2
    assert sample(metrics, "durability_worker_hold_seconds_count") == 2
    assert sample(metrics, "durability_worker_hold_seconds_sum") == 3
    assert sample(metrics, "durability_worker_hold_seconds_bucket", le="0.005") == 1


def test_an_unanswered_key_counts_once_while_it_stays_silent() -> None:
    gate, metrics, clock = counted_gate()
    gate.submit(FakeRequest())
    for _ in range(3):
        for message in gate.pump():
            gate.failed(message)
        clock.advance(2)
    assert sample(metrics, "durability_worker_unanswered_total") == 1
