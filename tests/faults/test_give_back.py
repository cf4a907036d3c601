# Messages the gate held when a Redis broker died: the lost channel cannot give
# them back (its restore meets the dead broker), so they would wait in Redis's
# unacked index for `visibility_timeout` (an hour by default), or longer when the
# crash left kombu's restore mutex set. `teardown.give_back` returns them over the
# next connection. Here a real Redis is killed under consumed, unacked messages,
# the old channel's restore fails as in Celery's teardown, and the broker restarts.
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from durability_celery.worker.teardown import Orphan, give_back, unreturned, watch_pops
from tests.faults.services import PrivateRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

QUEUE = Queue("work", Exchange("work", type="direct"), routing_key="work")


@pytest.fixture
def broker(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url(), decode_responses=True)
    yield client
    client.close()


def consume(url: str, count: int) -> tuple[Connection, list[Any]]:
    """Publish `count` messages and consume them unacked; returns the connection
    and the messages, as a worker holding them has."""
    connection = Connection(url)
    with Producer(connection.channel()) as producer:
        for n in range(count):
            producer.publish({"n": n}, exchange=QUEUE.exchange, routing_key="work",
                             declare=[QUEUE])
    delivered: list[Any] = []
    consumer = Consumer(connection.channel(), queues=[QUEUE],
                        callbacks=[lambda body, message: delivered.append(message)])
    consumer.consume()
    while len(delivered) < count:
        connection.drain_events(timeout=5)
    return connection, delivered


def lose(connection: Connection, messages: list[Any], private_redis: PrivateRedis) -> None:
    """Kill the broker; the channel's restore fails, as in Celery's teardown."""
    private_redis.kill()
    qos = messages[0].channel.qos
    with pytest.raises(connection.connection_errors):
        qos.restore_unacked_once()
    qos.restore_at_shutdown = False
    connection.collect()
    private_redis.start()


def queued(broker: redis.Redis) -> list[int]:
    """The queue's messages' numbers, next to be delivered first (BRPOP takes the tail)."""
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))["n"]
            for raw in reversed(broker.lrange("work", 0, -1))]


def test_held_messages_go_back_at_once(private_redis: PrivateRedis,
                                       broker: redis.Redis) -> None:
    connection, messages = consume(private_redis.url(), 3)
    since = time.time()
    lose(connection, messages, private_redis)
    assert broker.hlen("unacked") == 3, "the dead broker kept their unacked records"

    orphans = unreturned([Orphan(message, since) for message in messages])
    assert len(orphans) == 3
    with Connection(private_redis.url()) as fresh:
        assert give_back(fresh.default_channel, orphans) == 3
        assert queued(broker) == [0, 1, 2], "at the head of the queue, in their order"
        assert broker.hlen("unacked") == 0 and broker.zcard("unacked_index") == 0
        # Given back twice (a second start after another loss): nothing more happens.
        assert give_back(fresh.default_channel, orphans) == 0
    assert queued(broker) == [0, 1, 2]


def test_another_delivery_is_left_alone(private_redis: PrivateRedis,
                                        broker: redis.Redis) -> None:
    # `since` before the record was made: the record is a later delivery's (some
    # worker's restore_visible gave the message back and another consumer has it).
    before = time.time() - 5
    connection, messages = consume(private_redis.url(), 2)
    lose(connection, messages, private_redis)
    with Connection(private_redis.url()) as fresh:
        assert give_back(fresh.default_channel, [Orphan(m, before) for m in messages]) == 0
    assert broker.hlen("unacked") == 2 and broker.llen("work") == 0


def test_what_the_channel_gave_back_is_not_given_again(private_redis: PrivateRedis,
                                                       broker: redis.Redis) -> None:
    # The broker was up when the channel closed: kombu restored them itself.
    connection, messages = consume(private_redis.url(), 2)
    since = time.time()
    connection.close()
    assert broker.llen("work") == 2 and broker.hlen("unacked") == 0
    assert unreturned([Orphan(m, since) for m in messages]) == []


def test_a_broker_still_down_raises_and_changes_nothing(private_redis: PrivateRedis,
                                                        broker: redis.Redis) -> None:
    connection, messages = consume(private_redis.url(), 1)
    since = time.time()
    lose(connection, messages, private_redis)
    with Connection(private_redis.url()) as fresh:
        channel = fresh.default_channel
        private_redis.kill()  # again, after the next connection was made
        with pytest.raises(fresh.connection_errors):
            give_back(channel, [Orphan(messages[0], since)])
    private_redis.start()
    assert broker.hlen("unacked") == 1 and broker.llen("work") == 0


def test_a_message_popped_as_the_broker_died_goes_back(private_redis: PrivateRedis,
                                                       broker: redis.Redis) -> None:
    # A consumer's BRPOP took the message; the broker died before the consumer read
    # the reply (a solo pool's loop running a task), so writing its unacked record
    # fails. kombu drops it there; watch_pops keeps it for give_back.
    connection = Connection(private_redis.url())
    delivered: list[Any] = []
    consumer = Consumer(connection.channel(), queues=[QUEUE],
                        callbacks=[lambda body, message: delivered.append(message)])
    consumer.consume()
    unrecorded: list[Orphan] = []
    watch_pops(consumer.channel,
               lambda message, when: unrecorded.append(Orphan(message, when, unrecorded=True)))
    with pytest.raises(TimeoutError):
        connection.drain_events(timeout=0.05)  # the BRPOP is sent, and waits
    with Connection(private_redis.url()) as other, Producer(other.channel()) as producer:
        producer.publish({"n": 7}, exchange=QUEUE.exchange, routing_key="work")
    deadline = time.monotonic() + 5
    while broker.llen("work") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.llen("work") == 0, "the waiting BRPOP took it"
    time.sleep(0.1)  # its reply is in the consumer's socket now
    private_redis.kill()
    with pytest.raises(connection.connection_errors):
        connection.drain_events(timeout=5)
    assert not delivered and len(unrecorded) == 1
    connection.collect()
    private_redis.start()
    assert broker.llen("work") == 0 and broker.hlen("unacked") == 0, "no copy is left"

    assert unreturned(unrecorded) == unrecorded
    with Connection(private_redis.url()) as fresh:
        assert give_back(fresh.default_channel, unrecorded) == 1
    assert queued(broker) == [7]
