# An ack still pending when Celery tears a lost broker connection down. Celery
# defers acks to the event loop's next turn; the gate starts admitted tasks from
# timers and deferred calls, so on a solo pool such an ack was often pending when
# the broker died, and it then ran on a channel kombu had detached: AttributeError,
# not a connection error, so the worker died ("Unrecoverable error"). Here a real
# Redis is killed under a consumed message and the teardown is Celery's own
# sequence (our restore first, then collect and close); the ack runs after.
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker.request import Request
from kombu import Consumer
from vine import promise

from durability_celery.compat.worker import GatedConsumer
from durability_celery.worker.request import AdmittedRequest
from durability_celery.worker.teardown import restore_unacked_before_teardown
from tests.faults.services import PrivateRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def app(private_redis: PrivateRedis) -> Celery:
    # The request class under test is given explicitly: the task needs no admission.
    return Celery("stale_ack", broker=private_redis.url(), set_as_current=False)


def ack_after_teardown(app: Celery, private_redis: PrivateRedis, request_base: type, *,
                       gated: bool) -> Callable[[], None]:
    """Deliver one task message, acknowledge it as Celery does (the ack deferred),
    lose the broker and tear the connection down as Celery does, restart the
    broker; returns the deferred ack, to be run as the loop's next turn would.
    `gated`: the request gets the connection errors the admitted strategy gives
    Celery's (GatedConsumer), else the connection's own, as plain Celery's."""

    @app.task(shared=False)
    def job() -> None: ...

    job.delay()
    connection = app.connection_for_read()
    channel = connection.channel()
    delivered: list[Any] = []
    consumer = Consumer(channel, queues=[app.amqp.queues["celery"]],
                        callbacks=[lambda body, message: delivered.append(message)])
    consumer.consume()
    connection_errors = connection.connection_errors
    if gated:
        celery_consumer = SimpleNamespace(connection_errors=connection_errors)
        connection_errors = GatedConsumer(celery_consumer, lambda request: None
                                          ).connection_errors
    connection.drain_events(timeout=5)
    [message] = delivered
    pending: list[Callable[[], None]] = []
    # Celery's call_soon_ack, with the loop's next turn left to the caller.
    on_ack = promise(lambda fun, *args: pending.append(partial(fun, *args)),
                     (message.ack_log_error,))
    request = request_base(message, on_ack=on_ack, on_reject=on_ack, app=app,
                          hostname="stale@test", eventer=None, task=job,
                          connection_errors=connection_errors,
                          body=message.body, headers=message.headers, decoded=False,
                          utc=True)
    request.acknowledge()
    private_redis.kill()
    restore_unacked_before_teardown(SimpleNamespace(task_consumer=consumer))
    connection.collect()
    connection.close()
    private_redis.start()
    [ack] = pending
    return ack


def test_a_stale_ack_of_an_admitted_request_is_logged_not_raised(
        app: Celery, private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture) -> None:
    ack = ack_after_teardown(app, private_redis, AdmittedRequest, gated=True)
    with caplog.at_level(logging.CRITICAL, logger="celery.worker.request"):
        ack()
    assert "Couldn't ack" in caplog.text
    # Not acked: the broker still has it as unacked, to restore and deliver again.
    broker = redis.Redis.from_url(private_redis.url())
    assert broker.hlen("unacked") == 1


def test_a_stale_ack_of_a_plain_celery_request_raises(
        app: Celery, private_redis: PrivateRedis) -> None:
    # What killed the worker, and what the test above guards against.
    ack = ack_after_teardown(app, private_redis, Request, gated=False)
    with pytest.raises(AttributeError):
        ack()
