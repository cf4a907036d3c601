# The holder's reply publisher on a real Redis: inside a batch replies are
# buffered and sent together when it ends (kombu >= 5.7; older kombu has no
# Producer.batch and each goes at once), each to its queue with its
# correlation id and the queue's expiry (on every kombu); outside one, at
# once; a broker lost before a batch ends drops that batch's replies with a log
# line, and the next reply goes out on a new connection.
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Producer

from durability_celery.holder.replies import ReplyPublisher
from tests.faults.services import PrivateRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REDIS_DB = 1
EXPIRES = 60.0
BATCHES = hasattr(Producer, "batch")
"""kombu >= 5.7 (kombu PR #2572): replies inside a batch are buffered until it ends."""


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
        if BATCHES:  # buffered until the batch ends
            assert (server.llen("dc-test.reply.a"), server.llen("dc-test.reply.b")) == (0, 0)
        else:  # sent at once, already expiring
            assert (server.llen("dc-test.reply.a"), server.llen("dc-test.reply.b")) == (2, 1)
            assert 0 < server.pttl("dc-test.reply.a") <= EXPIRES * 1000
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
        if BATCHES:
            assert sent_at_once == 0
            assert "1 replies dropped" in caplog.text
        else:  # no batch to lose: the reply had reached the broker (and died with it)
            assert sent_at_once == 1
            assert "dropped" not in caplog.text
        broker.start()  # the same port, empty
        assert publisher.publish("dc-test.reply.a", "after", {"n": 2})
        assert received(broker.url(), "dc-test.reply.a") == [("after", {"n": 2})]
    finally:
        broker.kill()


def test_replies_carry_distinct_uuid4_delivery_tags(
        redis_url_factory: Callable[[int], str],
        publisher_on: Callable[[str], ReplyPublisher]) -> None:
    # Tags are made from random bytes read for many at a time (replies._delivery_tag),
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
    from durability_celery.holder import replies

    assert publisher._producer.channel._next_delivery_tag is replies._delivery_tag
