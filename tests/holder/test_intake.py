# The consumer's Redis fast path (holder/intake.py): after one BRPOP it takes what else
# waits with a pipelined RPOP, and every entry so taken is accepted, decoded and
# rejected exactly as kombu's one-message path does it. On real Redis, with requests
# queued before the holder starts, so most of them can only be taken by the fast path.
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Producer

from durability_celery.app import Durability
from durability_celery.holder import (
    holder_queue_declaration,
    intake,
    reply_queue_declaration,
)
from durability_celery.holder.service import Holder
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.wire.request import MAX_BODY_BYTES

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis_db(2)]

GOOD = {"type": "request", "v": 1, "semaphore": "jobs", "client_id": "c1",
        "demand": [{"group": None, "count": 1, "oldest_at": 1.0}], "grants": [], "leases": []}
KEYS = 40


class Rig:
    """A holder on real Redis (one shard) and SQLite, started on demand."""

    def __init__(self, redis_url: str, tmp_path: Path, *, client_url: str | None = None) -> None:
        self.app = Celery(f"intake-{uuid.uuid4().hex[:6]}", broker=redis_url,
                          set_as_current=False)
        tmp_path.mkdir(exist_ok=True)
        self.sem = DurabilitySemaphore("jobs", database=f"sqlite:///{tmp_path / 'd.db'}",
                                       limit=1000, round_wait=0.05, round_period=0.1)
        self.sem.migrate()
        self.durability = Durability(self.app, [self.sem], settings=DurabilitySettings(
            queue_prefix=f"dci{uuid.uuid4().hex[:6]}", shards=1))
        self.queue = self.durability.holder_queues()[0]
        self.reply_to = f"reply-{uuid.uuid4().hex[:6]}"
        # The test's own side (requests out, replies in) may connect as another Redis user
        # than the holder's.
        self.connection = (Connection(client_url) if client_url is not None
                           else self.app.connection_for_write())
        channel = self.connection.channel()
        holder_queue_declaration(self.queue)(channel).declare()
        self.producer = Producer(channel)
        self.replies: dict[str, Any] = {}
        self.consumer = Consumer(self.connection.channel(),
                                 [reply_queue_declaration(self.reply_to, expires=60)],
                                 no_ack=True, accept=["json"], on_message=self._on_reply)
        self.consumer.consume()
        self.redis = redis.Redis.from_url(redis_url)
        self.holder: Holder | None = None
        self.entries = 0
        """Entries put on the holder's queue."""

    def _on_reply(self, message: Any) -> None:
        self.replies[message.properties["correlation_id"]] = message.decode()

    def send(self, body: Any, **options: Any) -> str:
        correlation_id = uuid.uuid4().hex
        self.entries += 1
        self.producer.publish(body, exchange="", routing_key=self.queue,
                              reply_to=self.reply_to, correlation_id=correlation_id, **options)
        return correlation_id

    def push_raw(self, entry: bytes) -> None:
        """An entry no kombu producer makes, straight onto the queue's Redis list."""
        self.entries += 1
        self.redis.lpush(self.queue, entry)

    def start(self) -> Holder:
        self.holder = Holder(self.durability)
        self.holder.start()
        assert self.holder.consumer.consuming.wait(10)
        return self.holder

    def wait(self, correlation_ids: list[str], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while any(c not in self.replies for c in correlation_ids):
            assert time.monotonic() < deadline, "replies missing"
            with contextlib.suppress(TimeoutError):
                self.connection.drain_events(timeout=0.2)

    def close(self) -> None:
        if self.holder is not None:
            self.holder.stop(timeout=5)
        self.connection.release()
        self.redis.close()
        self.sem.close()


@pytest.fixture
def rig(redis_url: str, tmp_path: Path) -> Iterator[Rig]:
    made = Rig(redis_url, tmp_path)
    try:
        yield made
    finally:
        made.close()


def queue_everything(rig: Rig) -> dict[str, str]:
    """Good requests for KEYS keys with every kind of bad message between them; name ->
    correlation id (the good ones are `good-N`)."""
    sent: dict[str, str] = {}
    bad = {
        "garbage": lambda: rig.send(b"{not json", content_type="application/json",
                                    content_encoding="utf-8"),
        "pickle": lambda: rig.send({"a": 1}, serializer="pickle"),
        "list": lambda: rig.send([1, 2, 3], serializer="json"),
        "huge": lambda: rig.send({"pad": "x" * (MAX_BODY_BYTES + 10)}, serializer="json"),
        "unknown": lambda: rig.send({**GOOD, "key": "k", "semaphore": "nope"},
                                    serializer="json"),
        "no_key": lambda: rig.send({**GOOD, "key": 5}, serializer="json"),
        "empty_key": lambda: rig.send({**GOOD, "key": ""}, serializer="json"),
        "version": lambda: rig.send({**GOOD, "key": "kv", "v": 99}, serializer="json"),
        "compressed": lambda: rig.send(b"not gzip", content_type="application/json",
                                       content_encoding="utf-8",
                                       headers={"compression": "application/x-gzip"}),
    }
    for n in range(KEYS):
        sent[f"good-{n}"] = rig.send({**GOOD, "key": f"k{n}"}, serializer="json")
        if n % 4 == 0:
            name = list(bad)[(n // 4) % len(bad)]
            sent[name] = bad[name]()
    for name in bad.keys() - sent.keys():
        sent[name] = bad[name]()
    rig.push_raw(b"\x00not kombu")
    return sent


def answers(rig: Rig, sent: dict[str, str]) -> dict[str, Any]:
    """Each message's answer: the error for a bad one, the permits for a good one."""
    rig.wait(list(sent.values()))
    found = {}
    for name, cid in sent.items():
        reply = rig.replies[cid]
        found[name] = reply["error"] if "error" in reply else [
            g["permits"] for g in reply["grants"]]
    return found


def test_the_fast_path_takes_what_waits_and_answers_bad_input_as_kombu_does(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="durability_celery")
    results = {}
    for path in ("kombu", "fast"):
        with monkeypatch.context() as patched:
            if path == "kombu":  # what every other transport does: one message per wake-up
                patched.setattr("durability_celery.holder.consumer.redis_drain",
                                lambda *_args: None)
            made = Rig(redis_url, tmp_path / path)
            try:
                sent = queue_everything(made)
                holder = made.start()
                results[path] = answers(made, sent)
                drained, entries = holder.consumer.drained, made.entries
            finally:
                made.close()
        # The fast path took all but the first entry, which kombu's BRPOP took.
        assert drained == (0 if path == "kombu" else entries - 1), (path, drained)
    assert results["fast"] == results["kombu"]
    fast = results["fast"]
    assert all(fast[f"good-{n}"] == [1] for n in range(KEYS))
    codes = {name: error["code"] for name, error in fast.items() if isinstance(error, dict)}
    assert codes == {name: "invalid_message" for name in (
        "garbage", "pickle", "list", "huge", "no_key", "empty_key", "version", "compressed",
    )} | {"unknown": "unknown_semaphore"}
    dropped = [r for r in caplog.records if "undecodable broker entry" in r.getMessage()]
    assert len(dropped) == 2  # the raw entry, once per path


def test_an_entry_kombu_cannot_make_a_message_of_costs_only_itself(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # JSON without kombu's envelope: the entries taken with it are still served.
    caplog.set_level(logging.WARNING, logger="durability_celery")
    first = rig.send({**GOOD, "key": "before"}, serializer="json")
    rig.push_raw(b'{"body": "no properties"}')
    rig.push_raw(b"[1, 2]")
    later = [rig.send({**GOOD, "key": f"after-{n}"}, serializer="json") for n in range(5)]
    holder = rig.start()
    rig.wait([first, *later])
    assert all([g["permits"] for g in rig.replies[c]["grants"]] == [1] for c in [first, *later])
    assert holder.consumer.drained == 7
    warned = [r.getMessage() for r in caplog.records]
    assert len([m for m in warned if "undecodable broker entry" in m]) == 2, warned
    assert not any("connection lost" in m for m in warned), warned


def test_the_fast_path_is_redis_without_a_key_prefix_only(redis_url: str) -> None:
    # A global_keyprefix client rewrites a script's first key only: kombu's path then.
    for broker, options, fast in (("memory://", {}, False), (redis_url, {}, True),
                                  (redis_url, {"global_keyprefix": "p:"}, False)):
        app = Celery("intake-which", broker=broker, set_as_current=False)
        app.conf.broker_transport_options = options
        with app.connection_for_write() as connection:
            found = intake.redis_drain(connection, connection.channel(), ["q"])
        assert (found is not None) == fast, (broker, options)


def test_a_redis_that_refuses_scripts_is_served_one_message_at_a_time(
        redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A real Redis user without scripting (ACL), as some managed services configure.
    caplog.set_level(logging.WARNING, logger="durability_celery")
    admin = redis.Redis.from_url(redis_url)
    user = f"dc-noscript-{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, nopass=True, keys=["*"], channels=["*"],
                      commands=["+@all", "-@scripting"])
    try:
        host, port_db = redis_url.split("://", 1)[1].split(":", 1)
        # Only the holder is refused scripts: kombu's own drain, reading the test's replies,
        # restores unacked messages under a lock it releases with a script.
        made = Rig(f"redis://{user}:x@{host}:{port_db}", tmp_path, client_url=redis_url)
        made.redis.close()
        made.redis = admin
        try:
            sent = [made.send({**GOOD, "key": f"k{n}"}, serializer="json") for n in range(5)]
            with contextlib.suppress(TimeoutError):  # an idle read, as a slow holder causes
                made.connection.drain_events(timeout=0.2)
            holder = made.start()
            made.wait(sent)
            assert holder.consumer.drained == 0
        finally:
            made.close()
    finally:
        admin.acl_deluser(user)
    assert all([g["permits"] for g in made.replies[c]["grants"]] == [1] for c in sent)
    warned = [r.getMessage() for r in caplog.records]
    assert any("one at a time" in m for m in warned), warned
    assert not any("connection lost" in m for m in warned), warned


def test_plain_json_requests_skip_kombus_decoder_and_marked_ones_take_it(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # compat.wire.decoded_json: the same result as kombu's Message.decode, which runs only for
    # a body its object hook could change (kombu's type marker, or a \u escape).
    from kombu.message import Message

    decoded: list[Any] = []
    kombus = Message.decode

    def counted(message: Any) -> Any:
        if b'"type": "request"' in message.body:  # not the test's own reply consumer's
            decoded.append(message.body)
        return kombus(message)

    monkeypatch.setattr(Message, "decode", counted)
    plain = [rig.send({**GOOD, "key": f"p{n}"}, serializer="json") for n in range(5)]
    escaped = rig.send({**GOOD, "key": "caf\u00e9"}, serializer="json")
    marked = rig.send({**GOOD, "key": "m", "client_id": {"__type__": "uuid",
                                                          "__value__": str(uuid.uuid4())}},
                      serializer="json")
    rig.start()
    rig.wait([*plain, escaped, marked])
    assert all([g["permits"] for g in rig.replies[c]["grants"]] == [1]
               for c in [*plain, escaped])
    assert rig.replies[marked]["error"]["code"] == "invalid_message"  # a UUID, not a string
    assert len(decoded) == 2 and b"__type__" in decoded[1] and b"\\u00e9" in decoded[0]
