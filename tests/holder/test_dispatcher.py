# The dispatcher thread with a stand-in semaphore and publisher (no broker, no
# database): replies only after run_rounds returned, one job per key at a time,
# a slow key does not stall the others, failures answer `unavailable` (a whole
# batch's, or one key's alone), due keys gather into batches while the round
# threads are busy, claim deadlines and unacknowledged leases in responses arm
# the alarm, and the replies of one pass over the inbox go out in one bounded
# batch.
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from durability_celery.errors import InfrastructureError
from durability_celery.holder import pressure as pressure_module
from durability_celery.holder.batching import Waiting
from durability_celery.holder.dispatcher import MAX_EVENTS_PER_PASS, Dispatcher

pytestmark = pytest.mark.timeout(30)


@dataclass
class Config:
    round_wait: float = 0.02
    round_period: float = 0.05


class FakeSemaphore:
    def __init__(self) -> None:
        self.config = Config()
        self.calls: list[tuple[str, str, int]] = []
        self.gates: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.deadline_after = 0.3
        self.answer = "grant"
        """What each reply carries: "grant" (unclaimed, with a claim deadline),
        "lease" (unacknowledged, dropped at expires_at) or "acked-lease"."""
        self.active: set[str] = set()
        self.overlap = False
        self.lock = threading.Lock()
        self.batches: list[list[str]] = []
        self.broken: set[str] = set()
        """Keys whose round raises on its own (the batch commits the others)."""

    def run_rounds(self, batch: list[tuple[str, list[dict[str, Any]]]]
                   ) -> list[list[dict[str, Any]] | Exception]:
        self.batches.append([key for key, _ in batch])
        if self.fail & {key for key, _ in batch}:
            raise InfrastructureError("database is down")  # the whole transaction fails
        return [RuntimeError("bad state") if key in self.broken
                else self.run_round(key, messages) for key, messages in batch]

    def run_round(self, key: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with self.lock:
            self.overlap |= key in self.active
            self.active.add(key)
        try:
            self.calls.append(("round", key, len(messages)))
            if key in self.gates:
                self.gates[key].wait(10)
            if key in self.fail:
                raise InfrastructureError("database is down")
            now = time.time()
            deadline = now + self.deadline_after
            timing = {"round_at": now, "next_request_at": now + self.config.round_period}
            if self.answer == "grant":
                return [{"v": 1, "n": m["n"], **timing, "grants": [
                    {"status": "active", "permits": 1, "claimed": 0,
                     "claim_deadline": deadline}]} for m in messages]
            lease = {"status": "active", "permits": 2, "drawn": 0, "expires_at": deadline,
                     "acknowledged": self.answer == "acked-lease"}
            return [{"v": 1, "n": m["n"], **timing, "grants": [], "leases": [lease]}
                    for m in messages]
        finally:
            with self.lock:
                self.active.discard(key)

    def reclaim(self, key: str) -> float | None:
        self.calls.append(("reclaim", key, 0))
        return None

    def deadlines(self) -> list[tuple[str, float]]:
        return []


@dataclass
class FakePublisher:
    """Replies published inside a batch are sent when it ends, as kombu's are."""

    sent: list[tuple[str, str | None, dict[str, Any], float]] = field(default_factory=list)
    batches: list[list[str | None]] = field(default_factory=list)
    """Correlation ids of each batch that sent something, in order."""
    _buffer: list[tuple[str, str | None, dict[str, Any]]] | None = None

    @contextmanager
    def batch(self) -> Iterator[None]:
        self._buffer = []
        try:
            yield
        finally:
            buffer, self._buffer = self._buffer, None
            if buffer:
                self.batches.append([c for _, c, _ in buffer])
                self.sent += [(r, c, b, time.monotonic()) for r, c, b in buffer]

    def publish(self, reply_to: str, correlation_id: str | None, body: dict[str, Any]) -> bool:
        if self._buffer is None:
            self.sent.append((reply_to, correlation_id, body, time.monotonic()))
        else:
            self._buffer.append((reply_to, correlation_id, body))
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def rig() -> Any:
    sem, pub = FakeSemaphore(), FakePublisher()
    dispatcher = Dispatcher(semaphores={"s": sem}, serves=lambda s, k: True, publisher=pub,
                            round_threads=2, scan_interval=100.0)  # type: ignore[arg-type]
    dispatcher.start()
    yield sem, pub, dispatcher
    dispatcher.stop(timeout=5)


def send(dispatcher: Dispatcher, key: str, n: int) -> None:
    dispatcher.submit(("s", key), Waiting({"n": n}, f"reply-{n}", f"c{n}", time.time()))


def wait_for(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_replies_follow_the_round_and_correlate(rig: Any) -> None:
    sem, pub, dispatcher = rig
    for n in range(3):
        send(dispatcher, "a", n)
    wait_for(lambda: len(pub.sent) == 3)
    assert [c for c in sem.calls if c[0] == "round"] == [("round", "a", 3)]
    assert sorted((r, c, b["n"]) for r, c, b, _ in pub.sent) == [
        ("reply-0", "c0", 0), ("reply-1", "c1", 1), ("reply-2", "c2", 2)]
    assert pub.batches == [["c0", "c1", "c2"]]  # one round's replies: one batch


def test_a_pass_over_a_full_inbox_is_bounded_and_keeps_the_order() -> None:
    # Queued before the thread starts, 250 answers are handled in passes of at most
    # MAX_EVENTS_PER_PASS, each pass's replies sent together, none lost or reordered.
    pub = FakePublisher()
    dispatcher = Dispatcher(semaphores={"s": FakeSemaphore()}, serves=lambda s, k: True,
                            publisher=pub, round_threads=1,  # type: ignore[arg-type]
                            scan_interval=100.0)
    count = 2 * MAX_EVENTS_PER_PASS + 50
    for n in range(count):
        dispatcher.answer_error(f"reply-{n}", f"c{n}", "unavailable", "test")
    dispatcher.start()
    try:
        wait_for(lambda: len(pub.sent) == count)
    finally:
        dispatcher.stop(timeout=5)
    assert [len(b) for b in pub.batches] == [MAX_EVENTS_PER_PASS, MAX_EVENTS_PER_PASS, 50]
    assert [c for b in pub.batches for c in b] == [f"c{n}" for n in range(count)]


def test_the_consumer_is_told_to_leave_requests_queued_while_the_dispatcher_is_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from durability_celery.holder import dispatcher as dispatcher_module

    monkeypatch.setattr(dispatcher_module, "MAX_WAITING", dispatcher_module.BEHIND_MARGIN + 3)
    pub = FakePublisher()
    dispatcher = Dispatcher(semaphores={"s": FakeSemaphore()}, serves=lambda s, k: True,
                            publisher=pub, round_threads=1,  # type: ignore[arg-type]
                            scan_interval=100.0)
    # Not started: events wait in the inbox, one per wake-up of the consumer.
    for n in range(dispatcher_module.BEHIND_EVENTS):
        dispatcher.submit_many([(("s", f"k{n}"), Waiting({"n": n}, "r", f"c{n}", 0.0))])
    assert not dispatcher.behind()
    dispatcher.submit_many([(("s", "one-more"), Waiting({}, "r", "c", 0.0))])
    assert dispatcher.behind()
    # Handled, they wait for rounds: past MAX_WAITING - BEHIND_MARGIN it is behind again.
    assert dispatcher._handle_events(0.0)
    assert dispatcher._batcher.waiting_count() == dispatcher_module.BEHIND_EVENTS + 1
    assert dispatcher.behind()
    dispatcher._batcher.drop_waiting()
    assert not dispatcher.behind()


def test_a_slow_key_does_not_stall_others_and_never_runs_twice(rig: Any) -> None:
    sem, pub, dispatcher = rig
    sem.gates["slow"] = threading.Event()
    send(dispatcher, "slow", 1)
    wait_for(lambda: ("round", "slow", 1) in sem.calls)
    send(dispatcher, "slow", 2)  # waits: its key's round is still running
    send(dispatcher, "fast", 3)
    wait_for(lambda: any(b["n"] == 3 for _, _, b, _ in pub.sent))
    assert not any(b.get("n") in (1, 2) for _, _, b, _ in pub.sent)  # nothing before commit
    sem.gates["slow"].set()
    wait_for(lambda: len(pub.sent) == 3)
    assert not sem.overlap


def test_a_failed_round_answers_unavailable_and_the_next_one_works(rig: Any) -> None:
    sem, pub, dispatcher = rig
    sem.fail.add("k")
    send(dispatcher, "k", 1)
    wait_for(lambda: len(pub.sent) == 1)
    assert pub.sent[0][2]["error"]["code"] == "unavailable"
    sem.fail.clear()
    send(dispatcher, "k", 2)
    wait_for(lambda: len(pub.sent) == 2)
    assert pub.sent[1][2]["n"] == 2


def test_claim_deadlines_in_responses_arm_the_reclaim_alarm(rig: Any) -> None:
    sem, pub, dispatcher = rig
    send(dispatcher, "k", 1)
    wait_for(lambda: len(pub.sent) == 1)
    sent_at = time.monotonic()
    wait_for(lambda: ("reclaim", "k", 0) in sem.calls, timeout=3)
    assert time.monotonic() - sent_at >= 0.2  # at the deadline (0.3 s), not at once


@pytest.mark.parametrize(("answer", "alarm"), [("lease", True), ("acked-lease", False)])
def test_an_unacknowledged_lease_arms_the_alarm_for_its_drop(rig: Any, answer: str,
                                                             alarm: bool) -> None:
    # Dropped at expires_at unless its client reports it; an acknowledged lease's
    # expires_at is its ttl, which the holder does not wake for.
    sem, pub, dispatcher = rig
    sem.answer = answer
    send(dispatcher, "k", 1)
    wait_for(lambda: len(pub.sent) == 1)
    sent_at = time.monotonic()
    if alarm:
        wait_for(lambda: ("reclaim", "k", 0) in sem.calls, timeout=3)
        assert time.monotonic() - sent_at >= 0.2
    else:
        time.sleep(1.0)
        assert ("reclaim", "k", 0) not in sem.calls


def _one_thread_busy_with_first() -> tuple[Any, Any, Dispatcher]:
    """A started dispatcher with one round thread, busy with key `first` until
    `sem.gates["first"]` is set: rounds due meanwhile wait for it."""
    sem, pub = FakeSemaphore(), FakePublisher()
    dispatcher = Dispatcher(semaphores={"s": sem}, serves=lambda s, k: True, publisher=pub,
                            round_threads=1, scan_interval=100.0)  # type: ignore[arg-type]
    sem.gates["first"] = threading.Event()
    dispatcher.start()
    send(dispatcher, "first", 0)
    wait_for(lambda: ("round", "first", 1) in sem.calls)
    return sem, pub, dispatcher


def test_due_keys_gather_into_one_batch_while_the_threads_are_busy() -> None:
    sem, pub, dispatcher = _one_thread_busy_with_first()
    try:
        for n in range(1, 6):  # due while the only round thread is busy
            send(dispatcher, f"k{n}", n)
        time.sleep(0.1)
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 6)
    finally:
        dispatcher.stop(timeout=5)
    assert sem.batches == [["first"], [f"k{n}" for n in range(1, 6)]]
    assert pub.batches[-1] == [f"c{n}" for n in range(1, 6)]  # one batch, one publish batch


def test_a_key_that_fails_alone_leaves_its_batch_answered() -> None:
    sem, pub, dispatcher = _one_thread_busy_with_first()
    sem.broken.add("bad")
    try:
        for n, key in enumerate(["good", "bad", "other"], start=1):
            send(dispatcher, key, n)
        time.sleep(0.1)
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 4)
    finally:
        dispatcher.stop(timeout=5)
    assert sem.batches[-1] == ["good", "bad", "other"]
    answers = {c: b for _, c, b, _ in pub.sent}
    assert answers["c2"]["error"]["code"] == "unavailable"
    assert answers["c1"]["n"] == 1 and answers["c3"]["n"] == 3


def test_due_rounds_waiting_for_busy_threads_make_it_say_it_is_overloaded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(pressure_module, "OVERLOAD_LAG", 0.1)
    sem, pub, dispatcher = _one_thread_busy_with_first()
    try:
        assert not dispatcher.overloaded
        with caplog.at_level("WARNING", logger="durability_celery.holder"):
            send(dispatcher, "next", 1)  # due, and no thread to run it
            wait_for(lambda: dispatcher.overloaded)
            send(dispatcher, "more", 2)
            time.sleep(0.05)
        assert caplog.text.count("overloaded") == 1  # logged once, not per pass
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 3)
        wait_for(lambda: not dispatcher.overloaded, timeout=15)  # the stretch shrinks back
    finally:
        dispatcher.stop(timeout=5)


def test_a_long_batch_with_nothing_else_due_stretches_nothing() -> None:
    # A batch that takes long is service time, not a backlog: a holder with its round
    # threads free is not behind, and stretching periods would only idle it.
    sem, pub, dispatcher = _one_thread_busy_with_first()
    try:
        time.sleep(0.5)  # ten round_periods in one batch, and nothing else due
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 1)
        time.sleep(0.3)  # past the pressure's next look
        assert dispatcher.pressure.extra == 0.0 and not dispatcher.overloaded
    finally:
        dispatcher.stop(timeout=5)
    answer = pub.sent[0][2]
    assert answer["next_request_at"] - answer["round_at"] <= sem.config.round_period


def test_a_holder_behind_stretches_the_next_request_at_of_its_replies() -> None:
    sem, pub, dispatcher = _one_thread_busy_with_first()
    try:
        send(dispatcher, "next", 1)  # due, and no thread to run it for a while
        time.sleep(1.2)
        assert dispatcher.overloaded and dispatcher.pressure.extra > sem.config.round_period
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 2)
    finally:
        dispatcher.stop(timeout=5)
    answer = {c: b for _, c, b, _ in pub.sent}["c1"]
    # More than the period by at least the share of the extra every round keeps.
    assert answer["next_request_at"] - answer["round_at"] > 1.4 * sem.config.round_period


def wire(client: str, n: int) -> dict[str, Any]:
    return {"type": "request", "v": 1, "semaphore": "s", "key": "k", "client_id": client,
            "demand": [], "grants": [], "leases": [], "n": n}


def test_superseded_requests_get_the_newest_ones_answer_without_a_place_in_the_round(
) -> None:
    sem, pub, dispatcher = _one_thread_busy_with_first()
    try:
        for n, client in enumerate(["c1", "c2", "c1", "c1"], start=1):
            dispatcher.submit(("s", "k"), Waiting(wire(client, n), f"reply-{n}", f"c{n}",
                                                  time.time()))
        time.sleep(0.1)
        sem.gates["first"].set()
        wait_for(lambda: len(pub.sent) == 5)
    finally:
        dispatcher.stop(timeout=5)
    assert ("round", "k", 2) in sem.calls  # c2's request and c1's newest
    answers = {c: b["n"] for _, c, b, _ in pub.sent}
    assert answers == {"c0": 0, "c1": 4, "c2": 2, "c3": 4, "c4": 4}
    assert dispatcher.pressure.shed == 2
