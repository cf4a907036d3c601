# The holder on RabbitMQ + PostgreSQL: a real `celery worker --durability-holder`
# consuming its shard queues from RabbitMQ, blocking clients on a contended key
# (rounds, grants, the limit), and the shard queues as quorum queues: refused
# while the holder declares them classic, served once both sides declare them
# quorum (docs/operations.md, RabbitMQ).
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from amqp.exceptions import PreconditionFailed
from kombu import Connection

from durability_celery.queues import holder_queue_declaration

from .conftest import HERE, Backend, HolderRig, semaphore_config
from .conftest import RABBITMQ_URL as RABBITMQ
from .holder_app import CONFIG_ENV
from .test_holder import run_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

QUORUM = {"x-queue-type": "quorum"}
LIMIT = 2


@pytest.fixture
def rabbitmq_backend(holder_pg_url: str) -> Backend:
    from support import reset_postgres

    reset_postgres(holder_pg_url)
    return Backend("rabbitmq+postgresql", {"broker_url": RABBITMQ}, holder_pg_url)


@pytest.fixture
def rabbitmq_rig(make_rig: Callable[..., HolderRig], rabbitmq_backend: Backend,
                 request: pytest.FixtureRequest) -> Iterator[HolderRig]:
    """A rig on RabbitMQ whose shard queues are deleted at the end (they are durable);
    its shard_queue_type is the test's indirect parameter, classic by default."""
    queue_type = getattr(request, "param", "classic")
    rig = make_rig(rabbitmq_backend, [semaphore_config(
        "jobs", rabbitmq_backend.database, limit=LIMIT, round_wait=0.05, round_period=0.3,
        grant_timeout=5.0)], {"shard_queue_type": queue_type})
    try:
        yield rig
    finally:
        with Connection(RABBITMQ) as connection:
            channel = connection.channel()
            for name in rig.durability.holder_queues():
                channel.queue_delete(name)


def _contended_key(rig: HolderRig) -> None:
    """Two clients ask for more than the limit of one key: the first round grants the
    limit to the first, the second finds no room; then four clients loop on the key and
    never hold more than the limit together."""
    key = f"acct-{uuid.uuid4().hex[:6]}"
    first, second = rig.client(timeout=10.0), rig.client(timeout=10.0)
    for n in range(3):
        first.client.enqueue(key, None, f"first-{n}", enqueued_at=1.0 + n)
        second.client.enqueue(key, None, f"second-{n}", enqueued_at=2.0 + n)
    replies = [first.request(key), second.request(key)]
    assert all(reply["contended"] for reply in replies), replies
    assert sum(g["permits"] for g in replies[0]["grants"]) == LIMIT, replies[0]
    assert replies[1]["grants"] == [] and replies[1]["blocked"], replies[1]
    state = rig.semaphore().state(key)
    assert state.rounds == len({reply["round_at"] for reply in replies})
    assert sorted(g.grant_id for g in state.grants) == sorted(
        g["grant_id"] for g in replies[0]["grants"])
    for n in range(3):  # withdrawn: the unclaimed grant goes back with the final reports
        first.client.cancel(f"first-{n}")
        second.client.cancel(f"second-{n}")
    assert first.close(timeout=10.0) and second.close(timeout=10.0)

    pairs = [(rig.client(timeout=10.0), key) for _ in range(4)]
    seen, errors = run_workers(pairs, rounds=3)
    assert errors == []
    assert seen.admitted == 4 * 3 and seen.peak[key] == LIMIT, seen.peak
    assert all(client.close(timeout=10.0) for client, _ in pairs)
    assert rig.semaphore().usage(key).outstanding == 0, rig.semaphore().state(key)


def test_a_holder_on_rabbitmq_serves_a_contended_key(rabbitmq_rig: HolderRig) -> None:
    rabbitmq_rig.start_holder()
    _contended_key(rabbitmq_rig)


def _declare(names: list[str], arguments: dict[str, Any] | None) -> None:
    with Connection(RABBITMQ) as connection:
        channel = connection.channel()
        for name in names:
            holder_queue_declaration(name, arguments=arguments)(channel).declare()


def test_quorum_shard_queues_are_refused_to_a_holder_that_declares_them_classic(
        rabbitmq_rig: HolderRig) -> None:
    rig = rabbitmq_rig
    _declare(rig.durability.holder_queues(), QUORUM)
    proc = rig.processes.start_worker(
        "holder_app", "--durability-holder", "--pool=solo",
        f"--queues={rig.durability.control_queue}", env={CONFIG_ENV: json.dumps(rig.config)},
        name="classic-holder", pythonpath=[HERE])
    proc.wait_for_log(r"inequivalent arg 'x-queue-type'", timeout=30)
    assert "durability holder: consuming" not in proc.log()


@pytest.mark.parametrize("rabbitmq_rig", ["quorum"], indirect=True)
def test_quorum_shard_queues_serve_a_contended_key(rabbitmq_rig: HolderRig) -> None:
    rig = rabbitmq_rig  # shard_queue_type="quorum": the holder and the clients declare so
    rig.start_holder()
    _contended_key(rig)
    # They are quorum queues: a classic declaration of one is refused.
    with pytest.raises(PreconditionFailed, match="inequivalent arg 'x-queue-type'"):
        _declare(rig.durability.holder_queues()[:1], None)
