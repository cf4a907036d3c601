# durability_celery/compat/ without services: the version check's one line;
# each kombu shim's two implementations, on objects of a kombu that has the
# feature and of one that lacks it (fakes standing in for the other kombu), and
# the choice made at import matching the installed kombu's features (this file
# runs on every release scripts/versions tests); and that no module outside
# compat/ reaches Celery's or kombu's internals.
from __future__ import annotations

import ast
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Producer, Queue
from kombu.transport import filesystem

from durability_celery import compat
from durability_celery.app import Durability
from durability_celery.compat import broker, redis_qos
from durability_celery.errors import ConfigurationError
from tests.support import redis_db_url


def test_the_installed_versions_are_supported() -> None:
    compat.check_versions()


@pytest.mark.parametrize("celery, kombu", [
    ("5.4.0", "5.4.2"), ("5.5.3", "5.5.4"), ("5.6.3", "5.6.2"), ("5.7.0", "5.7.0"),
    ("5.7.9", "5.7.99"), ("5.4.0rc1", "5.4.2"),
])
def test_supported_pairs_pass(celery: str, kombu: str) -> None:
    compat.check_versions({"celery": celery, "kombu": kombu})


@pytest.mark.parametrize("celery, kombu, line", [
    ("5.3.6", "5.7.0", "durability-celery supports celery >=5.4,<5.8; installed: 5.3.6"),
    ("5.8.0", "5.7.0", "durability-celery supports celery >=5.4,<5.8; installed: 5.8.0"),
    ("6.0.0b1", "5.7.0", "durability-celery supports celery >=5.4,<5.8; installed: 6.0.0b1"),
    ("5.7.0", "5.4.1", "durability-celery supports kombu >=5.4.2,<5.8; installed: 5.4.1"),
    ("5.7.0", "5.8.0", "durability-celery supports kombu >=5.4.2,<5.8; installed: 5.8.0"),
    ("5.7.0", None, "durability-celery supports kombu >=5.4.2,<5.8; installed: none"),
])
def test_an_unsupported_version_is_one_clear_line(celery: str, kombu: str | None,
                                                  line: str) -> None:
    installed = {"celery": celery} | ({"kombu": kombu} if kombu else {})
    with pytest.raises(ConfigurationError) as caught:
        compat.check_versions(installed)
    assert str(caught.value) == line


def test_durability_checks_the_versions_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_installed", {"celery": "5.3.6", "kombu": "5.3.7"}.get)
    with pytest.raises(ConfigurationError, match=r"^durability-celery supports celery"):
        Durability(Celery("compat-check"), [])


# Producer.batch (kombu PR #2572)

class _NoBatchProducer:
    """A producer of kombu < 5.7: no batch()."""


def test_a_producer_without_batches_publishes_at_once() -> None:
    assert broker.no_batch(_NoBatchProducer()) is None


def test_a_producer_with_batches_opens_one() -> None:
    opened: list[int] = []

    class BatchProducer:
        def batch(self) -> contextlib.AbstractContextManager[None]:
            opened.append(1)
            return contextlib.nullcontext()

    batch = broker.batch_of(BatchProducer())
    assert batch is not None and opened == [1]  # made, not yet entered


def test_the_installed_kombus_producer() -> None:
    with Connection("memory://") as connection:
        batch = compat.open_publish_batch(connection.Producer())
        assert (batch is not None) == hasattr(Producer, "batch")


# Redis list names: the holder takes and expires what kombu's own BRPOP reads.

def test_redis_lists_are_the_ones_kombu_pushes_to_in_its_brpop_order() -> None:
    with Connection(redis_db_url(0)) as connection:
        channel = connection.default_channel
        lists = compat.redis_lists(channel, ["dc.a", "dc.b"])
        steps = channel.priority_steps
        assert [queue for _, queue in lists] == ["dc.a", "dc.b"] * len(steps)
        assert lists[:2] == [("dc.a", "dc.a"), ("dc.b", "dc.b")]  # priority 0: the name
        for priority in (0, 9):  # kombu files a message under its priority's list
            assert channel._q_for_pri("dc.a", priority) in {name for name, _ in lists}


def _first_delivered(connection: Connection, queue: Queue) -> Any:
    got: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda _, message: got.append(message)],
                             prefetch_count=1):
        while not got:
            connection.drain_events(timeout=5)
    return got[0]


@pytest.mark.parametrize("first", [True, False])
def test_a_requeued_redis_message_is_delivered_next_only_when_put_first(first: bool) -> None:
    # kombu's own reject(requeue=True) puts it behind what was published since.
    queue = Queue("dc.requeue-first", routing_key="dc.requeue-first")
    with Connection(redis_db_url(0)) as connection:
        queue(connection.default_channel).purge()
        producer = Producer(connection.default_channel)
        for body in "abc":
            producer.publish(body, routing_key=queue.routing_key, declare=[queue])
        message = _first_delivered(connection, queue)
        assert message.payload == "a"
        if first:
            assert redis_qos.requeue_first(message) is True
            assert message.acknowledged, "settled on its channel, as a reject would be"
        else:
            message.reject(requeue=True)
        bodies = []
        for _ in range(3):
            again = _first_delivered(connection, queue)
            again.ack()
            bodies.append(again.payload)
        assert bodies == (["a", "b", "c"] if first else ["b", "c", "a"])
        assert queue(connection.default_channel).purge() == 0, "delivered once each"


def test_a_message_put_first_and_taken_at_once_by_another_worker_is_its_alone() -> None:
    # The delivery tag travels with the payload: the other worker's unacked record has
    # the same tag, and a reject on the first channel after the restore would restore
    # that record too, delivering the message twice.
    queue = Queue("dc.requeue-first", routing_key="dc.requeue-first")
    with Connection(redis_db_url(0)) as first, Connection(redis_db_url(0)) as second:
        queue(first.default_channel).purge()
        Producer(first.default_channel).publish("a", routing_key=queue.routing_key,
                                                declare=[queue])
        message = _first_delivered(first, queue)
        assert redis_qos.requeue_first(message)
        taken = _first_delivered(second, queue)
        assert taken.delivery_tag == message.delivery_tag
        unacked, _ = redis_qos.unacked_keys(second.default_channel) or ("", "")
        records = second.default_channel.client.hkeys(unacked)
        assert [bytes(tag).decode() for tag in records] == [taken.delivery_tag]
        first.default_channel.qos.restore_unacked_once()  # the first worker stops
        taken.ack()
        assert queue(second.default_channel).purge() == 0, "delivered once"


def test_requeue_first_leaves_other_transports_to_their_broker(tmp_path: Path) -> None:
    queue = Queue("dc.requeue-first", routing_key="dc.requeue-first")
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path)}
    with Connection("filesystem://", transport_options=options) as connection:
        Producer(connection.default_channel).publish("a", routing_key=queue.routing_key,
                                                     declare=[queue])
        message = _first_delivered(connection, queue)
        assert redis_qos.requeue_first(message) is False
        message.ack()


# The holder's own push of replies: the text and the list kombu's Producer uses.

@pytest.mark.parametrize("body", [
    {"round_at": 1764806400.125, "grants": [{"grant_id": "g1", "group": None}]},
    {"error": {"code": "x", "message": "caf\u00e9 \u2603 \"q\""}}, {"n": 2 ** 70}, [],
])
@pytest.mark.parametrize("correlation_id", ["c-1", None])
@pytest.mark.parametrize("reply_to", [None, "dc.reply.caf\u00e9-1"])
def test_a_redis_envelope_reads_as_what_kombus_producer_pushes(
        body: Any, correlation_id: str | None, reply_to: str | None) -> None:
    # The same text but for the body's JSON, which is compact: a consumer finds the same
    # envelope fields and, decoding the body as kombu does, the same values.
    import redis

    from durability_celery.compat.wire import redis_envelope, redis_list_of

    url = redis_db_url(0)
    server = redis.Redis.from_url(url)
    server.delete("dc.compat.envelope")
    with Connection(url) as connection:
        producer = connection.Producer(serializer="json")
        compat.tag_deliveries(producer.channel, lambda: "tag-1")
        # kombu writes a reply_to it is given, even None; the holder's replies give none.
        replies = {} if reply_to is None else {"reply_to": reply_to}
        producer.publish(body, exchange="", routing_key="dc.compat.envelope",
                         correlation_id=correlation_id, serializer="json", **replies)
        mine = redis_envelope(producer.channel, body, routing_key="dc.compat.envelope",
                              correlation_id=correlation_id, reply_to=reply_to,
                              delivery_tag="tag-1")
        target = redis_list_of(producer.channel)("dc.compat.envelope")
    assert target == "dc.compat.envelope"
    [pushed] = server.lrange(target, 0, -1)
    server.delete(target)
    theirs, ours = json.loads(pushed), json.loads(mine)
    assert {**ours, "body": None} == {**theirs, "body": None}
    assert (_kombu_body(producer.channel, ours) == _kombu_body(producer.channel, theirs)
            == body)


def _kombu_body(channel: Any, envelope: dict[str, Any]) -> Any:
    """What kombu's consumer reads as the body of a pushed Redis `envelope`."""
    from kombu.utils.json import loads

    raw = channel.decode_body(envelope["body"], envelope["properties"]["body_encoding"])
    return loads(raw)


# kombu's JSON decoding, through Python's shared decoder where the result is the same.

JSON_TEXTS = [
    '{"type": "request", "key": "k", "demand": [{"group": null, "count": 2}]}',
    '{"when": {"__type__": "datetime", "__value__": "2026-01-02T03:04:05"}}',  # kombu's marker
    '{"\\u005f_type__": "uuid", "__value__": "0b8d4a2e-1c6f-4d8a-9e0f-2a3b4c5d6e7f"}',
    '{"x": "caf\\u00e9"}', '[1, 2.5, true, null]', '"text"', '{"broken": ', '',
    # Where Python's decoder and pydantic-core's could part: a lone surrogate escape,
    # infinities, huge integers, repeated keys, deep nesting, trailing text.
    '["\\ud800"]', '[Infinity, -Infinity, 1e400]', '[123456789012345678901234567890]',
    '{"a": 1, "a": 2}', "[" * 500 + "]" * 500, '{"a": 1} x', '[1.0, -0.0, -0, 1E5]',
]


def _outcome(call: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except Exception as exc:
        return "error", type(exc)


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_json_loads_is_kombus(text: str) -> None:
    from kombu.utils.json import loads

    from durability_celery.compat.wire import json_loads

    assert _outcome(json_loads, text) == _outcome(loads, text)


@pytest.mark.parametrize("body", [text.encode() for text in JSON_TEXTS] + [b"\xff{}"])
@pytest.mark.parametrize("content_type", ["application/json", "application/x-yaml"])
def test_decoded_json_is_kombus_decode(body: bytes, content_type: str) -> None:
    from kombu.message import Message

    from durability_celery.compat.wire import decoded_json

    def message() -> Any:
        return Message(body=body, content_type=content_type, content_encoding="utf-8",
                       accept=["json"])

    assert _outcome(decoded_json, message()) == _outcome(lambda: message().decode())


# filesystem _exchange_file (kombu PR #2645) and the temporary name (kombu #2646/#2647)

def test_exchange_file_without_kombus_helper(tmp_path: Path) -> None:
    class OldChannel:
        control_folder = tmp_path

    expected = tmp_path / "celery.pidbox.exchange"
    assert broker.local_exchange_file(OldChannel(), "celery.pidbox") == expected


def test_exchange_file_with_kombus_helper_is_kombus(tmp_path: Path) -> None:
    class NewChannel:
        control_folder = tmp_path

        def _exchange_file(self, exchange: str) -> Path:
            return tmp_path / "by-kombu"

    assert broker.kombus_exchange_file(NewChannel(), "x") == tmp_path / "by-kombu"


def test_the_local_exchange_path_matches_the_installed_kombu(tmp_path: Path) -> None:
    options = {"control_folder": str(tmp_path / "control"), "data_folder_in": str(tmp_path),
               "data_folder_out": str(tmp_path)}
    with Connection("filesystem://", transport_options=options) as connection:
        channel: Any = connection.default_channel
        assert isinstance(channel, filesystem.Channel)
        expected = tmp_path / "control" / "reply.exchange"
        if hasattr(filesystem.Channel, "_exchange_file"):
            assert channel._exchange_file("reply") == expected
        assert compat.exchange_file(channel, "reply") == expected


@pytest.mark.parametrize("queue", ["celery", "msg", "tmp", "durability.batch.0", ""])
def test_a_temporary_name_is_never_a_message_of_any_queue(tmp_path: Path, queue: str) -> None:
    final = tmp_path / f"1234_5678.{queue}.msg"
    tmp = compat.temporary_beside(final)
    assert tmp.parent == final.parent and tmp != final
    assert ".msg" not in tmp.name  # kombu < 5.7 matches ".<queue>.msg" anywhere in a name
    assert compat.temporary_beside(final) != tmp


# Nothing outside compat/ reaches Celery's worker internals or kombu's transports

_INTERNAL_MODULES = ("celery.worker.state", "celery.worker.strategy", "celery.worker.consumer",
                     "celery.concurrency", "kombu.transport.redis", "kombu.transport.virtual",
                     "kombu.transport.filesystem")
_PRIVATE_NAMES = {"_raw", "_dirty", "_delivered", "_do_restore_message", "_q_for_pri",
                  "_exchange_file", "_get_queue_expire", "_context", "_limit_task",
                  "_limit_post_eta", "_put", "_queue_bind", "_eta_timer_entry"}
"""Underscore attributes of Celery's and kombu's objects that compat/ reaches."""


def _outside_compat() -> Iterator[tuple[Path, ast.AST]]:
    package = Path(compat.__file__).parent.parent
    for path in sorted(package.rglob("*.py")):
        if "compat" not in path.relative_to(package).parts:
            yield from ((path, node) for node in ast.walk(ast.parse(path.read_text())))


def test_only_compat_imports_celery_and_kombu_internals() -> None:
    found = []
    for path, node in _outside_compat():
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [f"{node.module}.{alias.name}" for alias in node.names]
                 if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}: {name}" for name in names
                  if name.startswith(_INTERNAL_MODULES)]
    assert found == []


def test_only_compat_touches_celery_and_kombu_private_attributes() -> None:
    found = [f"{path.name}:{node.lineno}" for path, node in _outside_compat()
             if (isinstance(node, ast.Attribute) and node.attr in _PRIVATE_NAMES)
             or (isinstance(node, ast.Constant) and node.value in _PRIVATE_NAMES)]
    assert found == []
