# The holder's reply publisher on a real Redis: inside a batch replies are
# buffered and pushed together when it ends, by the publisher itself (on every
# kombu), as the text kombu's Producer pushes but for the body's compact JSON,
# which a kombu consumer takes as kombu's own; each to its queue with its
# correlation id and the queue's expiry; outside one, by kombu at once; a broker
# lost before a batch ends drops that batch's replies with a log line, and the
# next reply goes out on a new connection.
from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from durability_celery.holder.replies import ReplyPublisher
from durability_celery.queues import reply_queue_declaration
from tests.faults.services import PrivateRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REDIS_DB = 1
EXPIRES = 60.0


@pytest.fixture
def publisher_on() -> Iterator[Callable[[str], ReplyPublisher]]:
    made: list[ReplyPublisher] = []

    def make(url: str) -> ReplyPublisher:
        made.append(ReplyPublisher(Celery(broker=url), reply_expires=EXPIRES))
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()


def received(url: str, queue: str) -> list[tuple[str, Any]]:
    """(correlation id, body) of every message in `queue`, taken off it."""
    out = []
    with Celery(broker=url).connection_for_read() as connection:
        simple = connection.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                message = simple.get(timeout=0.2)
                out.append((message.properties["correlation_id"], message.payload))
        except simple.Empty:
            pass
        finally:
            simple.close()
    return out


def test_a_batch_sends_its_replies_when_it_ends(
        redis_url_factory: Callable[[int], str],
        publisher_on: Callable[[str], ReplyPublisher]) -> None:
    url = redis_url_factory(REDIS_DB)
    server = redis.Redis.from_url(url)
    publisher = publisher_on(url)
    with publisher.batch():
        assert publisher.publish("dc-test.reply.a", "c1", {"n": 1})
        assert publisher.publish("dc-test.reply.b", "c2", {"n": 2})
        assert publisher.publish("dc-test.reply.a", "c3", {"n": 3})
        # buffered until the batch ends (the Redis fast path), whatever the kombu
        assert (server.llen("dc-test.reply.a"), server.llen("dc-test.reply.b")) == (0, 0)
    for queue in ("dc-test.reply.a", "dc-test.reply.b"):
        assert 0 < server.pttl(queue) <= EXPIRES * 1000  # a gone client's queue expires
    assert received(url, "dc-test.reply.a") == [("c1", {"n": 1}), ("c3", {"n": 3})]
    assert received(url, "dc-test.reply.b") == [("c2", {"n": 2})]
    # outside a batch: at once
    assert publisher.publish("dc-test.reply.a", "c4", {"n": 4})
    assert server.llen("dc-test.reply.a") == 1
    # an empty batch touches nothing, and a batch after a batch works as the first
    with publisher.batch():
        pass
    with publisher.batch():
        assert publisher.publish("dc-test.reply.b", "c5", {"n": 5})
    assert received(url, "dc-test.reply.b") == [("c5", {"n": 5})]


def test_a_broker_lost_before_the_batch_ends_drops_it_and_the_next_reply_goes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        publisher_on: Callable[[str], ReplyPublisher]) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    try:
        publisher = publisher_on(broker.url())
        caplog.set_level(logging.WARNING, logger="durability_celery.holder")
        with publisher.batch():
            assert publisher.publish("dc-test.reply.a", "lost", {"n": 1})
            probe = redis.Redis.from_url(broker.url())
            sent_at_once = probe.llen("dc-test.reply.a")
            probe.close()
            broker.kill()
        assert sent_at_once == 0
        assert "1 replies dropped" in caplog.text
        broker.start()  # the same port, empty
        assert publisher.publish("dc-test.reply.a", "after", {"n": 2})
        assert received(broker.url(), "dc-test.reply.a") == [("after", {"n": 2})]
    finally:
        broker.kill()


def test_replies_carry_distinct_uuid4_delivery_tags(
        redis_url_factory: Callable[[int], str],
        publisher_on: Callable[[str], ReplyPublisher]) -> None:
    # Tags are made from random bytes read for many at a time (pushes.delivery_tag),
    # in kombu's own form.
    import json
    import uuid

    url = redis_url_factory(REDIS_DB)
    publisher = publisher_on(url)
    with publisher.batch():
        for n in range(300):  # past one read of random bytes
            assert publisher.publish("dc-test.reply.tags", f"c{n}", {"n": n})
    raw = redis.Redis.from_url(url).lrange("dc-test.reply.tags", 0, -1)
    tags = [json.loads(entry)["properties"]["delivery_tag"] for entry in raw]
    assert len(set(tags)) == 300
    assert all(str(uuid.UUID(tag)) == tag and uuid.UUID(tag).version == 4 for tag in tags)
    assert len(received(url, "dc-test.reply.tags")) == 300  # kombu takes them as its own
    from durability_celery.compat import pushes

    assert publisher._producer.channel._next_delivery_tag is pushes.delivery_tag


BODIES: list[dict[str, Any]] = [
    {"round_at": 1764806400.123456, "next_request_at": 1764806402.5, "contended": False,
     "grants": [{"grant_id": "g" * 32, "permits": 2, "claimed": 0, "status": "active",
                 "claim_deadline": 1764806410.25, "group": None}], "leases": []},
    {"error": {"code": "invalid_message", "message": "caf\u00e9 \u2603 \"quoted\""}},
    {"n": 2 ** 70, "tiny": 1.5e-07, "nested": [True, None, {"x": []}]},
]


def test_a_batch_pushes_what_kombu_would_push_but_for_the_bodys_json(
        redis_url_factory: Callable[[int], str], publisher_on: Callable[[str], ReplyPublisher],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from durability_celery import compat
    from durability_celery.compat import pushes

    url = redis_url_factory(REDIS_DB)
    server = redis.Redis.from_url(url)
    tags = iter(f"tag-{n}" for n in range(100))
    monkeypatch.setattr(pushes, "delivery_tag", lambda: next(tags))
    publisher = publisher_on(url)
    with publisher.batch():
        for n, body in enumerate(BODIES):
            assert publisher.publish("dc-test.reply.fast", f"c{n}", body)
        assert publisher.publish("dc-test.reply.fast", None, {"no": "correlation id"})
        assert publisher._pushes is not None and len(publisher._pushes) == 4  # the fast path
        assert server.llen("dc-test.reply.fast") == 0
    fast = server.lrange("dc-test.reply.fast", 0, -1)

    kombu_tags = iter(f"tag-{n}" for n in range(100))
    with Connection(url) as connection:
        producer = connection.Producer(serializer="json")
        compat.tag_deliveries(producer.channel, lambda: next(kombu_tags))
        for n, body in enumerate(BODIES):
            producer.publish(body, exchange="", routing_key="dc-test.reply.kombu",
                             correlation_id=f"c{n}", serializer="json")
        producer.publish({"no": "correlation id"}, exchange="",
                         routing_key="dc-test.reply.kombu", correlation_id=None,
                         serializer="json")
    by_kombu = server.lrange("dc-test.reply.kombu", 0, -1)
    assert len(fast) == len(by_kombu) == 4
    for ours, theirs in zip(fast, by_kombu, strict=True):
        # The same envelope; the body's JSON is compact, and decodes to the same values.
        mine, kombus = json.loads(ours), json.loads(theirs.replace(b".kombu", b".fast"))
        assert {**mine, "body": None} == {**kombus, "body": None}
        assert (json.loads(base64.b64decode(mine["body"]))
                == json.loads(base64.b64decode(kombus["body"])))


def test_a_kombu_consumer_takes_the_fast_path_replies_as_kombu_published_ones(
        redis_url_factory: Callable[[int], str],
        publisher_on: Callable[[str], ReplyPublisher]) -> None:
    url = redis_url_factory(REDIS_DB)
    publisher = publisher_on(url)
    with publisher.batch():  # the fast path
        for n, body in enumerate(BODIES):
            assert publisher.publish("dc-test.reply.fast", f"c{n}", body)
    for n, body in enumerate(BODIES):  # outside a batch: kombu's own publish
        assert publisher.publish("dc-test.reply.kombu", f"c{n}", body)

    def consumed(queue: str) -> list[dict[str, Any]]:
        taken: list[dict[str, Any]] = []
        with Connection(url) as connection, connection.Consumer(
                [reply_queue_declaration(queue, expires=EXPIRES)], accept=["json"],
                no_ack=True, on_message=lambda m: taken.append({
                    "payload": m.payload, "content_type": m.content_type,
                    "content_encoding": m.content_encoding, "headers": m.headers,
                    "properties": {k: v for k, v in m.properties.items()
                                   if k not in ("delivery_tag", "delivery_info")},
                    "routing_key": m.delivery_info["routing_key"]})):
            while len(taken) < len(BODIES):
                connection.drain_events(timeout=5)
        return taken

    fast, by_kombu = consumed("dc-test.reply.fast"), consumed("dc-test.reply.kombu")
    assert [m["payload"] for m in fast] == BODIES
    assert [m["properties"]["correlation_id"] for m in fast] == ["c0", "c1", "c2"]
    for mine, theirs in zip(fast, by_kombu, strict=True):
        assert mine["routing_key"] == "dc-test.reply.fast"
        assert {**mine, "routing_key": None} == {**theirs, "routing_key": None}
