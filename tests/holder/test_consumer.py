# The holder's consumer refuses what no round could serve before it reaches the
# dispatcher: a key that is empty or longer than the store's key column is
# answered `invalid_message` with one warning line, and nothing is written.
# In process, on kombu's in-memory broker and SQLite: the consumer's checks
# need no real broker, and they must not depend on one. A broker that cannot be
# reached is retried with growing waits until the holder stops.
from __future__ import annotations

import contextlib
import logging
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from kombu import Consumer, Producer

from durability_celery.app import Durability
from durability_celery.holder import holder_queue_declaration, reply_queue_declaration
from durability_celery.holder.service import Holder
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.wire.fields import MAX_KEY_LENGTH

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    app = Celery(f"consumer-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    sem = DurabilitySemaphore("jobs", database=f"sqlite:///{tmp_path / 'd.db'}", limit=3,
                              round_wait=0.05, round_period=0.1)
    sem.migrate()
    running = Holder(Durability(app, [sem], settings=DurabilitySettings(
        queue_prefix=f"dcc{uuid.uuid4().hex[:6]}", shards=1)))
    running.start()
    try:
        assert running.consumer.consuming.wait(10)
        yield running
    finally:
        running.stop(timeout=5)
        sem.close()


def ask(holder: Holder, key: str) -> dict[str, Any]:
    """Publish one request for `key` to the holder's queue; its reply."""
    app = holder.consumer._app
    replies: list[dict[str, Any]] = []
    reply_to = f"reply-{uuid.uuid4().hex[:6]}"
    with app.connection_for_write() as connection:
        channel = connection.channel()
        queue = holder.consumer._queue_names[0]
        holder_queue_declaration(queue)(channel).declare()
        with Consumer(channel, [reply_queue_declaration(reply_to, expires=60)], no_ack=True,
                      accept=["json"], callbacks=[lambda body, _m: replies.append(body)]):
            Producer(channel).publish(
                {"type": "request", "v": 1, "semaphore": "jobs", "key": key,
                 "client_id": "c1", "demand": [{"group": None, "count": 1, "oldest_at": 1.0}],
                 "grants": [], "leases": []},
                exchange="", routing_key=queue, reply_to=reply_to, serializer="json",
                correlation_id="c-1")
            deadline = time.monotonic() + 10
            while not replies and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    connection.drain_events(timeout=0.1)
    assert replies, "no reply from the holder"
    return replies[0]


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_LENGTH + 1)], ids=["empty", "too-long"])
def test_a_key_no_round_could_serve_is_an_invalid_message(
        holder: Holder, key: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="durability_celery")
    reply = ask(holder, key)
    assert reply["error"]["code"] == "invalid_message", reply
    assert "key: must be a non-empty string of at most 200 chars" in reply["error"]["message"]
    records = [r for r in caplog.records if r.name.startswith("durability_celery")]
    assert [r.levelname for r in records] == ["WARNING"], [r.getMessage() for r in records]
    assert "invalid_message" in records[0].getMessage()
    assert records[0].exc_info is None and "\n" not in records[0].getMessage()
    sem = next(iter(holder._semaphores.values()))
    with sem.engine.connect() as conn:  # no round ran: not even the key row was written
        assert conn.execute(sa.select(sa.func.count()).select_from(
            sa.table("durability_semaphore_keys"))).scalar() == 0
    # and the holder still serves a good key
    assert [g["permits"] for g in ask(holder, "fine")["grants"]] == [1]


@pytest.mark.redis_db(2)
def test_the_backlog_is_the_queued_requests_over_the_rate_they_were_taken(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the dispatcher's lag cannot see: requests still in the shard queues. Counted
    # on the real broker (kombu's queue_declare), over the rate the consumer takes them.
    from durability_celery.holder import consumer as consumer_module

    clock = [100.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: clock[0])
    app = Celery(f"backlog-{uuid.uuid4().hex[:6]}", broker=redis_url, set_as_current=False)
    names = [f"dcb{uuid.uuid4().hex[:6]}.holder.{n}" for n in range(2)]
    with app.connection_for_write() as connection:
        queues = [holder_queue_declaration(name) for name in names]
        backlog = consumer_module._Backlog(connection.channel(), queues)
        producer = Producer(connection.channel())
        for n in range(300):
            producer.publish({"n": n}, exchange="", routing_key=names[n % 2])
        assert backlog.wait(taken=0) is None  # not yet time for a look
        clock[0] += consumer_module.BACKLOG_EVERY
        assert backlog.wait(taken=150) == pytest.approx(300 / 150)  # 150 taken in 1 s
        clock[0] += consumer_module.BACKLOG_EVERY
        # None taken (idle, or starved): at the rate a consumer takes them at least.
        assert backlog.wait(taken=150) == pytest.approx(300 / consumer_module.MIN_TAKE_RATE)


def test_an_unreachable_broker_is_retried_with_growing_waits_until_the_holder_stops(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Nothing listens on the broker's port: each attempt is refused at once, kombu's
    # ensure_connection waits longer before each next one, and a stop ends the retries.
    caplog.set_level(logging.INFO, logger="durability_celery")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = Celery(f"unreachable-{uuid.uuid4().hex[:6]}", broker=f"redis://127.0.0.1:{port}/0",
                 set_as_current=False)
    sem = DurabilitySemaphore("jobs", database=f"sqlite:///{tmp_path / 'd.db'}", limit=3)
    sem.migrate()
    holder = Holder(Durability(app, [sem], settings=DurabilitySettings(
        queue_prefix=f"dcu{uuid.uuid4().hex[:6]}", shards=1)))
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while len(waits := _reconnect_waits(caplog)) < 3:
            assert time.monotonic() < deadline, waits
            time.sleep(0.05)
        assert waits[:3] == sorted(waits[:3]) and waits[0] < waits[2], waits
    finally:
        stopping = time.monotonic()
        holder.stop(timeout=5)
        sem.close()
    assert not holder.consumer._thread.is_alive()
    assert time.monotonic() - stopping < 2.5
    assert not any("consuming" in r.getMessage() for r in caplog.records)


def _reconnect_waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    found = [re.search(r"reconnecting in ([\d.]+)s", r.getMessage()) for r in caplog.records]
    return [float(match.group(1)) for match in found if match]
