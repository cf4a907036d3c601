# A real holder pushed past its capacity: rounds made slow by a limit callback
# that takes LIMIT_DELAY per key, one round thread, and more busy keys than it can
# give a round each round_period. Clients ask as the library's do (a blocked
# client at its reply's next_request_at, less ask_early); the holder stretches
# next_request_at (holder/pressure.py) so 99 % of replies come within
# request_timeout once the burst has arrived, and none is an error. (Run with
# the stretch disabled, 415 of 587 replies came after request_timeout.)
from __future__ import annotations

import contextlib
import heapq
import statistics
import time
import uuid
from typing import Any

import pytest
from kombu import Consumer, Producer

from durability_celery.core.config import GATHER
from durability_celery.holder import holder_queue_declaration, reply_queue_declaration
from durability_celery.wire.request import DemandEntry, Request

from .conftest import Backend, HolderRig, semaphore_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMIT_DELAY = 0.02
"""Seconds each key's round costs the holder (serial, one round thread): about 50
key-rounds/s at best."""
KEYS, PERIOD, REQUEST_TIMEOUT = 100, 1.0, 2.0
"""120 busy keys asking every second: two or three times what the holder can serve.
Served in turn without back-pressure, a key's cycle takes KEYS / capacity (2.4 s or
more), and a blocked client's request waits about that long: past REQUEST_TIMEOUT."""
RAMP, RUN = 4.0, 12.0


class Clients:
    """One simulated client per key, each with one request in flight at a time."""

    def __init__(self, rig: HolderRig, keys: list[str]) -> None:
        self.rig = rig
        self.connection = rig.durability.app.connection_for_write()
        self.reply_to = f"{rig.durability.settings.queue_prefix}.reply.sim-{uuid.uuid4().hex[:6]}"
        channel = self.connection.channel()
        Consumer(channel, [reply_queue_declaration(self.reply_to, expires=60)], no_ack=True,
                 accept=["json"], on_message=self._on_message).consume()
        self.producer = Producer(self.connection.channel())
        for queue in {rig.durability.queue_for("busy", k) for k in keys}:
            holder_queue_declaration(queue)(self.producer.channel).declare()
        self.in_flight: dict[str, tuple[str, float]] = {}
        self.due: list[tuple[float, str]] = []
        self.latencies: list[tuple[float, float]] = []
        """(sent at, seconds to its reply)"""
        self.told: list[float] = []
        """Each reply's next_request_at - round_at."""
        self.errors: list[Any] = []

    def send(self, key: str) -> None:
        body = Request(type="request", client_id=f"sim-{key}",
                       demand=(DemandEntry(None, 1, 1.0),)).to_wire(semaphore="busy", key=key)
        correlation_id = uuid.uuid4().hex
        self.in_flight[correlation_id] = (key, time.monotonic())
        self.producer.publish(body, exchange="", serializer="json",
                              routing_key=self.rig.durability.queue_for("busy", key),
                              reply_to=self.reply_to, correlation_id=correlation_id)

    def _on_message(self, message: Any) -> None:
        now = time.monotonic()
        key, sent_at = self.in_flight.pop(message.properties["correlation_id"])
        body = message.decode()
        self.latencies.append((sent_at, now - sent_at))
        if "error" in body:
            self.errors.append(body)
            wait = 0.5
        else:
            wait = body["next_request_at"] - body["round_at"]
            self.told.append(wait)
        heapq.heappush(self.due, (now + max(0.0, wait - GATHER), key))

    def run(self, keys: list[str], seconds: float) -> None:
        start = time.monotonic()
        for n, key in enumerate(keys):  # the busy keys arrive over RAMP
            heapq.heappush(self.due, (start + RAMP * n / len(keys), key))
        while time.monotonic() < start + seconds:
            while self.due and self.due[0][0] <= time.monotonic():
                self.send(heapq.heappop(self.due)[1])
            wait = self.due[0][0] - time.monotonic() if self.due else 0.05
            with contextlib.suppress(TimeoutError):
                self.connection.drain_events(timeout=min(0.05, max(0.001, wait)))

    def close(self) -> None:
        self.connection.release()


def test_an_overloaded_holder_answers_within_request_timeout(
        redis_pg_backend: Backend, make_rig: Any) -> None:
    rig: HolderRig = make_rig(redis_pg_backend, [semaphore_config(
        "busy", redis_pg_backend.database, limit=0, limit_delay=LIMIT_DELAY,
        round_wait=0.2, round_period=PERIOD)],
        settings={"round_threads": 1, "request_timeout": REQUEST_TIMEOUT})
    holder = rig.start_holder()
    keys = [f"acct-{n}-{uuid.uuid4().hex[:4]}" for n in range(KEYS)]
    clients = Clients(rig, keys)
    try:
        clients.run(keys, RUN)
    finally:
        clients.close()
    start = min(sent for sent, _ in clients.latencies)
    settled = [seconds for sent, seconds in clients.latencies if sent > start + RAMP]
    assert clients.errors == []
    assert len(settled) > KEYS
    # Once it has caught up with the burst: p99 within request_timeout (served
    # in turn without back-pressure, most took longer). While it arrives, a blocked
    # client's request parked for its period waits that plus the lag.
    p99 = statistics.quantiles(settled, n=100)[98]
    assert p99 < REQUEST_TIMEOUT, (p99, max(settled), statistics.median(settled))
    assert max(seconds for _, seconds in clients.latencies) < REQUEST_TIMEOUT + PERIOD
    assert all(time.monotonic() - sent < REQUEST_TIMEOUT + 1.0
               for _, sent in clients.in_flight.values())
    # It stretched next_request_at: unstretched, a reply tells exactly PERIOD; by how
    # much depends on how far behind the machine let it fall.
    assert max(clients.told) > 1.2 * PERIOD
    assert "overloaded" in holder.log()
