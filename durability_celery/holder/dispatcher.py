# The holder's scheduling thread: takes requests from the consumer thread,
# starts the rounds the Batcher says are due, many keys' rounds of one
# semaphore in one batch (one transaction: `run_rounds`), and each reclaim, on
# a thread pool, and publishes the answers. Rules: SQL runs only on the pool
# threads (jobs.py); replies are published only after `run_rounds` returned (its
# transaction committed), and only from this thread, which owns the reply
# connection. Due rounds are taken only when a round thread is free, so under
# load they gather into larger batches instead of queueing one by one; past
# that, the holder stretches periods (pressure.py) and sheds superseded
# requests (shedding.py).
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..wire.error import error_message_of, error_reply, is_error
from .batching import Batcher, KeyId, Round, Waiting
from .jobs import BatchDone, ReclaimDone, ScanDone, run_batch, run_reclaim, scan
from .outcomes import blocked_by, claim_deadlines, first_round_at
from .pressure import Pressure
from .replies import ReplyPublisher

if TYPE_CHECKING:
    from ..metrics import HolderMetrics

logger = logging.getLogger("durability_celery.holder")

RETRY_AFTER_FAILURE = 2.0
"""A reclaim that failed (database down) is tried again this much later."""
MAX_WAITING = 50_000
"""Requests held for rounds at once; more are answered `unavailable` so a flood
cannot exhaust the holder's memory (clients back off and ask again)."""
MAX_SLEEP = 0.5
"""Longest wait for an event, so a stop is noticed promptly even without one."""
MAX_BATCH = 200
"""Most keys whose rounds run in one transaction: bounds how long their rows stay
locked and how long one batch's replies wait for its slowest key."""
BEHIND_EVENTS = 16
"""Events waiting in the inbox from which the consumer stops taking more (`behind`)."""
BEHIND_MARGIN = 2_000
"""Requests short of MAX_WAITING from which the consumer stops taking more (`behind`)."""
MAX_EVENTS_PER_PASS = 100
"""Events handled between two looks at the due jobs; their replies go out together
(ReplyPublisher.batch). Bounded, so a busy inbox delays neither the replies nor
the next rounds."""


@dataclass(frozen=True)
class _Incoming:
    key_id: KeyId
    request: Waiting


@dataclass(frozen=True)
class _IncomingMany:
    requests: tuple[tuple[KeyId, Waiting], ...]
    """In arrival order: what the consumer took in one wake-up."""


@dataclass(frozen=True)
class _ErrorAnswer:
    reply_to: str
    correlation_id: str | None
    body: dict[str, Any]


@dataclass(frozen=True)
class _Queued:
    seconds: float


_STOP = object()
_CANCELLED = object()


class Dispatcher:
    """Runs rounds and reclaims for the keys of the shards this holder serves, in a
    thread of its own. It owns that thread rather than being one: a subclass of
    threading.Thread shares the namespace of its private attributes, which Python 3.13
    took `_handle` of."""

    def __init__(
        self,
        *,
        semaphores: dict[str, Any],
        serves: Callable[[str, str], bool],
        publisher: ReplyPublisher,
        round_threads: int,
        scan_interval: float,
        clock: Callable[[], float] = time.time,
        metrics: HolderMetrics | None = None,
    ) -> None:
        self._thread = threading.Thread(target=self.run, name="durability-holder-dispatcher",
                                        daemon=True)
        self._metrics = metrics
        self._semaphores = semaphores
        self._serves = serves
        self._publisher = publisher
        self._clock = clock
        self._scan_interval = scan_interval
        self._inbox: queue.Queue[object] = queue.Queue()
        self._batcher = Batcher(self._timing)
        self._pool = ThreadPoolExecutor(round_threads, thread_name_prefix="durability-round")
        self._round_threads = round_threads
        self._running = 0
        self._jobs = 0  # batches and reclaims started and not done: the busy round threads
        self.pressure = Pressure(self._shortest_period)
        """The holder's overload state and how it stretches periods (read anywhere)."""
        self._next_scan = 0.0

    @property
    def overloaded(self) -> bool:
        return self.pressure.overloaded

    # --- called from other threads ---------------------------------------

    def submit(self, key_id: KeyId, request: Waiting) -> None:
        self._inbox.put(_Incoming(key_id, request))

    def submit_many(self, requests: Sequence[tuple[KeyId, Waiting]]) -> None:
        """`submit` each, in order, as one event: one hand-over for a wake-up's requests."""
        if requests:
            self._inbox.put(_IncomingMany(tuple(requests)))

    def behind(self) -> bool:
        """Whether the consumer should leave requests in the shard queues: events wait
        unhandled, or the requests held for rounds near MAX_WAITING (past it, each new
        one is answered `unavailable`). Read from the consumer's thread: a hint."""
        return (self._inbox.qsize() > BEHIND_EVENTS
                or self._batcher.waiting_count() > MAX_WAITING - BEHIND_MARGIN)

    def queued_for(self, seconds: float) -> None:
        """Requests wait about `seconds` in the shard queues before they are taken."""
        self._inbox.put(_Queued(seconds))

    def answer_error(self, reply_to: str, correlation_id: str | None, code: str, text: str) -> None:
        self._inbox.put(_ErrorAnswer(reply_to, correlation_id, error_reply(code, text)))

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    # --- the thread --------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                try:
                    if not self._handle_events(self._wait_time()):
                        break
                    self._start_due_jobs()
                except Exception:
                    # A bug must not silently end the holder while its worker lives on.
                    logger.exception("durability holder: dispatcher error; continuing")
                    time.sleep(0.1)
        finally:
            self._finish()

    def _wait_time(self) -> float:
        wake = self._batcher.next_wake()
        if wake is None or self._jobs >= self._round_threads:  # a job's end wakes us
            return MAX_SLEEP
        return min(MAX_SLEEP, max(0.0, wake - self._clock()))

    def _handle_events(self, timeout: float) -> bool:
        """Handle the next event and up to MAX_EVENTS_PER_PASS queued behind it, their
        replies published together; False on stop."""
        try:
            event = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return True
        with self._publisher.batch():
            for handled in range(1, MAX_EVENTS_PER_PASS + 1):
                if event is _STOP:
                    return False
                self._handle(event)
                if handled == MAX_EVENTS_PER_PASS:
                    break  # the rest waits for the next pass, in order
                try:
                    event = self._inbox.get_nowait()
                except queue.Empty:
                    break
        return True

    def _handle(self, event: object) -> None:
        if isinstance(event, _IncomingMany):
            for key_id, request in event.requests:
                self._incoming(key_id, request)
        elif isinstance(event, _Incoming):
            self._incoming(event.key_id, event.request)
        elif isinstance(event, BatchDone):
            self._running -= 1
            self._jobs -= 1
            self.pressure.shed += event.shed
            for job, responses in event.rounds:
                self._round_done(job, responses)
        elif isinstance(event, ReclaimDone):
            self._running -= 1
            self._jobs -= 1
            self._batcher.finished(event.key_id)
            now = self._clock()
            deadline = now + RETRY_AFTER_FAILURE if event.failed else event.deadline
            self._batcher.replace_alarm(event.key_id, deadline, now=now)
            if not event.failed:
                self._batcher.freed(event.key_id, now)
        elif isinstance(event, ScanDone):
            self._running -= 1
            for key_id, deadline in event.deadlines:
                self._batcher.set_alarm(key_id, deadline)
        elif isinstance(event, _Queued):
            self.pressure.waited(event.seconds)
        elif event is _CANCELLED:
            self._running -= 1
        elif isinstance(event, _ErrorAnswer):
            self._publisher.publish(event.reply_to, event.correlation_id, event.body)

    def _incoming(self, key_id: KeyId, request: Waiting) -> None:
        if self._batcher.waiting_count() < MAX_WAITING:
            self._batcher.add(key_id, request)
        elif request.reply_to:
            self._publisher.publish(request.reply_to, request.correlation_id,
                                    error_reply("unavailable", "the holder is overloaded"))

    def _round_done(self, job: Round, responses: list[dict[str, Any]] | None) -> None:
        key_id = job.key_id
        period = float(self._semaphores[key_id[0]].config.round_period)
        # Its replies tell clients to come a stretched period later if the holder is
        # behind: the batcher gathers them then (parked requests wait for it). One share
        # of the extra for the whole round keeps its clients together.
        share = self.pressure.spread()
        told = self.pressure.period(period, share) if self.pressure.extra > 0.0 else None
        self._batcher.finished(key_id, round_at=first_round_at(responses),
                               blocked=blocked_by(job, responses), period=told)
        if responses is None:
            answers: Iterable[dict[str, Any]] = [
                error_reply("unavailable", "the holder's database failed; ask again later")
            ] * len(job.requests)
        else:
            answers = responses
            for deadline in claim_deadlines(responses):
                self._batcher.set_alarm(key_id, deadline)
            for response in responses:
                self.pressure.stretch_reply(response, period, share)
        for request, answer in zip(job.requests, answers, strict=True):
            if is_error(answer) and responses is not None:
                # Refused by validation (it changed nothing): say so even when
                # there is no one to answer, so hostile or broken senders show up.
                logger.warning("holder: refused a message for %s/%s (reply_to=%s): %s",
                               key_id[0], key_id[1], request.reply_to or "-",
                               error_message_of(answer))
            if request.reply_to:
                self._publisher.publish(request.reply_to, request.correlation_id, answer)

    def _start_due_jobs(self) -> None:
        now = self._clock()
        free = max(0, self._round_threads - self._jobs)
        # With no thread free this still clears the wakes that start no job (a slot
        # to forget wakes at once): the lag below is then that of due work only.
        rounds: dict[str, list[Round]] = {}
        for job in self._batcher.take_due(now, limit=free * MAX_BATCH):
            if isinstance(job, Round):
                rounds.setdefault(job.key_id[0], []).append(job)
            else:
                self._submit(run_reclaim, job)
        for jobs in rounds.values():
            for start in range(0, len(jobs), MAX_BATCH):
                self._submit(run_batch, jobs[start:start + MAX_BATCH])
        self._check_overload(now)
        if now >= self._next_scan:
            self._next_scan = now + self._scan_interval
            self._running += 1
            self._track(self._pool.submit(self._report, scan, self._semaphores, self._serves))

    def _check_overload(self, now: float) -> None:
        wake = self._batcher.next_wake()  # may be stale, never later than the first due job
        lag = 0.0 if wake is None else now - wake
        pressure = self.pressure
        pressure.observe(now, lag, self._batcher.waiting_count())
        if self._metrics is not None:
            self._metrics.load(pressure.lag, pressure.waiting, pressure.overloaded)

    def _submit(self, run: Callable[[dict[str, Any], Any], object], job: object) -> None:
        self._running += 1
        self._jobs += 1
        self._track(self._pool.submit(self._report, run, self._semaphores, job))

    def _report(self, run: Callable[..., object], *args: Any) -> None:
        # On a round thread: the job's event goes to this dispatcher's thread.
        self._inbox.put(run(*args))

    def _track(self, future: Future[None]) -> None:
        # A job cancelled at shutdown never reports back: count it as done.
        future.add_done_callback(
            lambda f: self._inbox.put(_CANCELLED) if f.cancelled() else None
        )

    def _finish(self) -> None:
        # Rounds already running commit anyway: wait (bounded) for them so their
        # clients hear back; requests still waiting are dropped and asked again.
        self._pool.shutdown(wait=False, cancel_futures=True)
        dropped = self._batcher.drop_waiting()
        if dropped:
            logger.info("durability holder: stopping, %d waiting request(s) dropped", len(dropped))
        deadline = time.monotonic() + 10.0
        while self._running > 0 and time.monotonic() < deadline:
            try:
                event = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if event is not _STOP and not isinstance(event, _Incoming | _IncomingMany):
                self._handle(event)
        self._publisher.close()

    def _timing(self, semaphore: str) -> tuple[float, float]:
        config = self._semaphores[semaphore].config
        return float(config.round_wait), float(config.round_period)

    def _shortest_period(self) -> float:
        return min((float(s.config.round_period) for s in self._semaphores.values()),
                   default=1.0)
