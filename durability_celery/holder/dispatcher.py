# The holder's scheduling thread: takes requests from the consumer thread,
# starts the rounds the Batcher says are due, many keys' rounds of one
# semaphore in one batch (one transaction: `run_rounds`), and each reclaim, on
# a thread pool, and publishes the answers. Rules: SQL runs only on the pool
# threads; replies are published only after `run_rounds` returned (its
# transaction committed), and only from this thread, which owns the reply
# connection. Due rounds are taken only when a round thread is free, so under
# load they gather into larger batches instead of queueing one by one.
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InfrastructureError, SchemaMissing
from ..queues import error_reply
from .batching import Batcher, KeyId, Reclaim, Round, Waiting, asked_groups
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
OVERLOAD_LAG = 1.0
"""Seconds a due job may wait for a free round thread before the holder says it is
overloaded (`Dispatcher.overloaded`, and a warning at most every OVERLOAD_LOG_EVERY)."""
OVERLOAD_LOG_EVERY = 30.0
MAX_EVENTS_PER_PASS = 100
"""Events handled between two looks at the due jobs; their replies go out together
(ReplyPublisher.batch). Bounded, so a busy inbox delays neither the replies nor
the next rounds."""


@dataclass(frozen=True)
class _Incoming:
    key_id: KeyId
    request: Waiting


@dataclass(frozen=True)
class _ErrorAnswer:
    reply_to: str
    correlation_id: str | None
    body: dict[str, Any]


@dataclass(frozen=True)
class _BatchDone:
    rounds: tuple[tuple[Round, list[dict[str, Any]] | None], ...]
    """Each round with its responses; None: that round failed, nothing of it committed."""


@dataclass(frozen=True)
class _ReclaimDone:
    key_id: KeyId
    deadline: float | None
    failed: bool


@dataclass(frozen=True)
class _ScanDone:
    deadlines: list[tuple[KeyId, float]]


_STOP = object()
_CANCELLED = object()


class Dispatcher(threading.Thread):
    """Runs rounds and reclaims for the keys of the shards this holder serves."""

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
        super().__init__(name="durability-holder-dispatcher", daemon=True)
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
        self._next_overload_log = 0.0
        self.overloaded = False
        """Whether due rounds wait more than OVERLOAD_LAG for a round thread (read anywhere)."""
        self._next_scan = 0.0

    # --- called from other threads ---------------------------------------

    def submit(self, key_id: KeyId, request: Waiting) -> None:
        self._inbox.put(_Incoming(key_id, request))

    def answer_error(self, reply_to: str, correlation_id: str | None, code: str, text: str) -> None:
        self._inbox.put(_ErrorAnswer(reply_to, correlation_id, error_reply(code, text)))

    def stop(self, *, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self.join(timeout)

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
        if isinstance(event, _Incoming):
            if self._batcher.waiting_count() < MAX_WAITING:
                self._batcher.add(event.key_id, event.request)
            elif event.request.reply_to:
                self._publisher.publish(event.request.reply_to, event.request.correlation_id,
                                        error_reply("unavailable", "the holder is overloaded"))
        elif isinstance(event, _BatchDone):
            self._running -= 1
            self._jobs -= 1
            for job, responses in event.rounds:
                self._round_done(job, responses)
        elif isinstance(event, _ReclaimDone):
            self._running -= 1
            self._jobs -= 1
            self._batcher.finished(event.key_id)
            now = self._clock()
            deadline = now + RETRY_AFTER_FAILURE if event.failed else event.deadline
            self._batcher.replace_alarm(event.key_id, deadline, now=now)
            if not event.failed:
                self._batcher.freed(event.key_id, now)
        elif isinstance(event, _ScanDone):
            self._running -= 1
            for key_id, deadline in event.deadlines:
                self._batcher.set_alarm(key_id, deadline)
        elif event is _CANCELLED:
            self._running -= 1
        elif isinstance(event, _ErrorAnswer):
            self._publisher.publish(event.reply_to, event.correlation_id, event.body)

    def _round_done(self, job: Round, responses: list[dict[str, Any]] | None) -> None:
        key_id = job.key_id
        self._batcher.finished(key_id, round_at=_round_at(responses),
                               blocked=_blocked(job, responses))
        if responses is None:
            answers: Iterable[dict[str, Any]] = [
                error_reply("unavailable", "the holder's database failed; ask again later")
            ] * len(job.requests)
        else:
            answers = responses
            for deadline in _claim_deadlines(responses):
                self._batcher.set_alarm(key_id, deadline)
        for request, answer in zip(job.requests, answers, strict=True):
            if "error" in answer and responses is not None:
                # Refused by validation (it changed nothing): say so even when
                # there is no one to answer, so hostile or broken senders show up.
                logger.warning("holder: refused a message for %s/%s (reply_to=%s): %s",
                               key_id[0], key_id[1], request.reply_to or "-",
                               answer["error"].get("message"))
            if request.reply_to:
                self._publisher.publish(request.reply_to, request.correlation_id, answer)

    def _start_due_jobs(self) -> None:
        now = self._clock()
        free = self._round_threads - self._jobs
        if free > 0:
            rounds: dict[str, list[Round]] = {}
            for job in self._batcher.take_due(now, limit=free * MAX_BATCH):
                if isinstance(job, Round):
                    rounds.setdefault(job.key_id[0], []).append(job)
                else:
                    self._submit(self._run_reclaim, job)
            for jobs in rounds.values():
                for start in range(0, len(jobs), MAX_BATCH):
                    self._submit(self._run_batch, jobs[start:start + MAX_BATCH])
        self._check_overload(now)
        if now >= self._next_scan:
            self._next_scan = now + self._scan_interval
            self._running += 1
            self._track(self._pool.submit(self._scan))

    def _check_overload(self, now: float) -> None:
        wake = self._batcher.next_wake()  # may be stale, never later than the first due job
        lag = 0.0 if wake is None else now - wake
        self.overloaded = lag > OVERLOAD_LAG
        if self._metrics is not None:
            self._metrics.load(lag, self._batcher.waiting_count(), self.overloaded)
        if self.overloaded and now >= self._next_overload_log:
            self._next_overload_log = now + OVERLOAD_LOG_EVERY
            logger.warning(
                "durability holder: overloaded: due rounds wait %.1f s for a round thread, "
                "%d requests waiting; more holders (--durability-shards) or a longer "
                "round_period would help", lag, self._batcher.waiting_count())

    def _submit(self, run: Callable[[Any], None], job: object) -> None:
        self._running += 1
        self._jobs += 1
        self._track(self._pool.submit(run, job))

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
            if event is not _STOP and not isinstance(event, _Incoming):
                self._handle(event)
        self._publisher.close()

    # --- pool threads: the only place SQL runs ------------------------------

    def _timing(self, semaphore: str) -> tuple[float, float]:
        config = self._semaphores[semaphore].config
        return float(config.round_wait), float(config.round_period)

    def _run_batch(self, jobs: list[Round]) -> None:
        semaphore = jobs[0].key_id[0]
        try:
            batch = [(job.key_id[1], [r.body for r in job.requests]) for job in jobs]
            results = self._semaphores[semaphore].run_rounds(batch)
            if len(results) != len(jobs):
                raise RuntimeError(f"run_rounds returned {len(results)} results "
                                   f"for {len(jobs)} keys")
        except Exception as exc:  # the whole batch: nothing of it committed
            what = "round" if len(jobs) == 1 else f"round batch of {len(jobs)} keys"
            _log_failure(what, jobs[0].key_id, exc)
            results = [None] * len(jobs)
        try:
            done = tuple((job, _responses(job, result))
                         for job, result in zip(jobs, results, strict=True))
        except Exception:  # a bug must not leave these keys busy and this thread counted
            logger.exception("durability holder: answering a round batch failed")
            done = tuple((job, None) for job in jobs)
        self._inbox.put(_BatchDone(done))

    def _run_reclaim(self, job: Reclaim) -> None:
        semaphore, key = job.key_id
        try:
            deadline = self._semaphores[semaphore].reclaim(key)
        except Exception as exc:
            _log_failure("reclaim", job.key_id, exc)
            self._inbox.put(_ReclaimDone(job.key_id, None, failed=True))
            return
        self._inbox.put(_ReclaimDone(job.key_id, deadline, failed=False))

    def _scan(self) -> None:
        found: list[tuple[KeyId, float]] = []
        for name, semaphore in self._semaphores.items():
            try:
                # Every pending deadline, not only the due ones: a restarted
                # holder must follow deadlines set by the one before it.
                for key, deadline in semaphore.deadlines():
                    if self._serves(name, key):
                        found.append(((name, key), float(deadline)))
            except Exception as exc:
                _log_failure("deadline scan", (name, "*"), exc)
        self._inbox.put(_ScanDone(found))


def _responses(job: Round, result: object) -> list[dict[str, Any]] | None:
    """A round's responses, or None when it failed (None: with its whole batch, logged
    already) or answered the wrong number."""
    if result is None:
        return None
    if isinstance(result, Exception):
        _log_failure("round", job.key_id, result)
        return None
    if not isinstance(result, list) or len(result) != len(job.requests):
        logger.error("durability holder: round for %s/%s gave a wrong answer: %r",
                     job.key_id[0], job.key_id[1], result)
        return None
    return result


def _claim_deadlines(responses: Iterable[dict[str, Any]]) -> Iterable[float]:
    """Claim deadlines of the grants with unclaimed permits named in these responses,
    and the expiry of each unacknowledged lease (dropped then, see Lease.acknowledged)."""
    for response in responses:
        for grant in response.get("grants") or ():
            if (grant.get("status") == "active"
                    and grant.get("claimed", 0) < grant.get("permits", 0)
                    and isinstance(grant.get("claim_deadline"), int | float)):
                yield float(grant["claim_deadline"])
        for lease in response.get("leases") or ():
            if (lease.get("acknowledged") is False
                    and isinstance(lease.get("expires_at"), int | float)):
                yield float(lease["expires_at"])


def _round_at(responses: list[dict[str, Any]] | None) -> float | None:
    """The round's own timestamp, from any successful response."""
    for response in responses or ():
        at = response.get("round_at")
        if isinstance(at, int | float) and not isinstance(at, bool):
            return float(at)
    return None


def _blocked(job: Round, responses: list[dict[str, Any]] | None,
             ) -> dict[str, frozenset[str | None]] | None:
    """For each client the round answered, the groups whose demand it left blocked (all
    it asked for while the key is over its limit). None: the round failed."""
    if responses is None:
        return None
    blocked: dict[str, frozenset[str | None]] = {}
    for request, response in zip(job.requests, responses, strict=True):
        client = request.body.get("client_id")
        if not isinstance(client, str) or "error" in response:
            continue
        groups = {entry.get("group") for entry in response.get("blocked") or ()
                  if isinstance(entry, dict)}
        if response.get("over_limit"):
            groups |= asked_groups(request.body)
        blocked[client] = blocked.get(client, frozenset()) | groups
    return blocked


def _log_failure(what: str, key_id: KeyId, exc: Exception) -> None:
    if isinstance(exc, SchemaMissing):
        logger.error("durability holder: %s for %s/%s failed: %s", what, key_id[0], key_id[1],
                     exc)
    elif isinstance(exc, InfrastructureError) or _is_database_error(exc):
        logger.error("durability holder: %s for %s/%s failed, database unavailable: %r",
                     what, key_id[0], key_id[1], exc)
    else:
        logger.error("durability holder: %s for %s/%s failed", what, key_id[0], key_id[1],
                     exc_info=exc)


def _is_database_error(exc: Exception) -> bool:
    from sqlalchemy.exc import SQLAlchemyError

    return isinstance(exc, SQLAlchemyError)
