# The gate: one worker's client queue. Admitted-type requests wait here, in the
# main process, unacked and outside the pool, until a SemaphoreClient gives them
# a permit; then they go to the pool, and their ending releases the permit.
# Rules: a permit is taken only while the pool has a free slot (never spent
# waiting); each admitted task ends exactly once (by item, idempotent), and its
# permit is then released or passed on to the next held task of its key and
# group (SemaphoreClient.pass_on); one lock serializes every SemaphoreClient
# call. A task that ends in a pool thread is released by the event loop, before
# its next admission or pump.
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery.worker import state as worker_state

from ..client import Permit, SemaphoreClient
from ..errors import DurabilityError
from .request import instrument
from .task import (
    HEADER_ENQUEUED_AT,
    HEADER_GROUP,
    HEADER_KEY,
    HEADER_SEMAPHORE,
    AdmittedTask,
)

logger = logging.getLogger("durability_celery.worker")


@dataclass
class Held:
    """A request waiting in the client queue for a permit."""

    request: Any
    semaphore: str
    key: str
    group: str | None
    enqueued_at: float
    held_since: float
    raised_qos: bool


@dataclass(frozen=True)
class Outgoing:
    """A request or sync message to publish to the holder of (semaphore, key)."""

    semaphore: str
    key: str
    correlation_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Hooks:
    """What the gate needs from the Celery consumer (all called with the lock held)."""

    handoff: Callable[[Any], None]
    """Give an admitted request to the pool (the real `on_task_request`)."""
    pool_size: Callable[[], int]
    busy: Callable[[], int]
    """Pool slots taken by work the gate did not admit."""
    qos_increment: Callable[[], None]
    qos_decrement: Callable[[], None]
    wake: Callable[[bool], None]
    """Ask the event loop to run `pump` soon (callable from any thread). The argument is
    `collect`: True when messages to the holder may be due now, False when the pump
    need only start requests whose permits are at hand."""
    run_deferred: Callable[[], None] | None = None
    """Run what `handoff` deferred (a solo pool's tasks, which run inside the call):
    called by `submit` and `release` once the lock is released, and by the step after
    each pump. Re-entered from a task it runs, it returns: the outer call goes on. None:
    `handoff` defers nothing (every pool but solo), and there is nothing to call."""
    admitted: Callable[[str, str, str, float], None] | None = None
    """Told of each admission: semaphore, key, permit source, seconds held (metrics)."""
    unanswered: Callable[[str, str], None] | None = None
    """Told when a key's holder leaves its requests unanswered (metrics)."""


@dataclass
class GateState:
    held: dict[str, Held] = field(default_factory=dict)
    running: dict[str, str] = field(default_factory=dict)
    """Admitted, unreleased item -> semaphore name."""
    raised: int = 0
    admitted_from: dict[str, int] = field(
        default_factory=lambda: {"lease": 0, "grant": 0, "handoff": 0})
    """Admissions by how they got a permit: drawn from a lease, claimed from a grant, or
    passed on from a task of the same key and group that ended."""
    released: int = 0
    """Admitted tasks that ended (their permit released or passed on)."""
    passed: list[tuple[str, Permit]] = field(default_factory=list)
    """Permits passed on by an ending task, to start at the next pump."""
    let_go: list[tuple[Any, float]] = field(default_factory=list)
    """(request, when) of held messages handed back while the broker could not take them
    (the reject failed): forget_held gives them to the step with the held ones."""


def _revoked(request: Any) -> bool:
    """`request.revoked()` (which acks and marks a revoked one), asked only when it may
    say yes, as Celery's strategy does: it runs for every admitted task, and is slower
    than these lookups. Unlike the strategy's, this test includes revokes by stamp."""
    return bool((request.expires or request.id in worker_state.revoked
                 or (worker_state.revoked_stamps and request.stamped_headers))
                and request.revoked())


WATCH_INTERVAL = 1.0
"""Seconds between two looks for keys whose holder does not answer."""


def _acknowledged(request: Any) -> bool:
    message = getattr(request, "message", None)
    return message is None or bool(message.acknowledged)


def item_id(request: Any, headers: Mapping[str, Any] | None = None) -> str:
    """The client-queue item of one delivery: the task id plus its retry count.

    A retry is a new message with the same task id that may arrive before the
    attempt that sent it has released; it must queue for its own permit, while
    a redelivery of the same attempt must not. `headers`: the request's
    `request_dict`, if the caller has it (a property that builds nothing, but a call).
    """
    if headers is None:
        headers = request.request_dict
    return f"{request.id}#{headers.get('retries') or 0}"


class Gate:
    """The client queue of one worker incarnation, for every configured semaphore."""

    def __init__(self, clients: Mapping[str, SemaphoreClient], hooks: Hooks, *,
                 max_held: int, hold_deadline: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.clients = dict(clients)
        self.hooks = hooks
        self.max_held = max_held
        self.hold_deadline = hold_deadline
        self.clock = clock
        self.state = GateState()
        self.loop_thread: int | None = None
        """The event loop's thread, where a release happens at once and may hand its
        passed-on permit's task to the pool (a prefork pool's results arrive there; a
        solo pool runs its tasks there, and `handoff` defers them to `run_deferred`, so
        chains do not nest). A release in any other thread (a pool thread) is made by the
        loop (see release). Set by the step when the loop starts; None: no such thread."""
        self.lock = threading.RLock()
        self._release_hook = self.release  # bound once: every admitted request carries it
        self._ended: deque[str] = deque()
        """Items whose tasks ended in a pool thread, for the event loop to release before
        its next admission or pump (see release)."""
        self._waited_on = False
        """Others wait on some key of some semaphore (SemaphoreClient.waited_on_any): a
        pool thread's release then wakes a collecting pump, since it may be news for the
        holder. Updated with every reply (only a reply makes a key waited on), and by stop.
        While it is False no key is waited on, and the per-task paths skip asking the
        client about their own key."""
        self._turn = 0
        for client in self.clients.values():
            client.free_slots = self._free
        self._unanswered: set[tuple[str, str]] = set()
        """(semaphore, key) whose holder has not answered while tasks waited (logged once)."""
        self._next_watch = 0.0
        # Correlation ids: unique per gate without a urandom call per message.
        self._correlation = itertools.count()
        self._correlation_prefix = uuid.uuid4().hex[:12]

    # -- requests arriving (event-loop thread) -------------------------------

    def submit(self, request: Any) -> None:
        """Start an admitted-type request (already reserved) on a permit at hand, or hold it
        until it gets one."""
        self._submit(request)
        # A solo pool's task runs here, still inside the message's own callback, as
        # Celery runs it: Celery defers its ack to the loop's next turn, which then
        # comes before the loop waits for the broker again.
        if self.hooks.run_deferred is not None:
            self.hooks.run_deferred()

    def _submit(self, request: Any) -> None:
        try:
            item, semaphore, key, group, enqueued_at = self._admission_of(request)
        except DurabilityError as exc:
            self._refuse(request, exc)
            return
        with self.lock:
            state = self.state
            if self._ended:
                self._release_ended()  # their slots and permits may serve this request
            previous = state.held.pop(item, None)
            if previous is not None:
                # Redelivered while held: keep the newer delivery (the broker's
                # unacked record now belongs to it) and restart its hold clock.
                worker_state.reserved_requests.discard(previous.request)
                previous.request, previous.held_since = request, self.clock()
                state.held[item] = previous
                return
            if item in state.running:
                logger.warning("durability: duplicate delivery of running task %s dropped",
                               request.id)
                request.acknowledge()
                worker_state.reserved_requests.discard(request)
                return
            # Passed-on permits start first: their tasks were admitted earlier; then held
            # tasks that a pool slot freed since the last pump lets start.
            if state.passed:
                self._start_passed()
            if state.held:
                self._admit()
            client = self.clients[semaphore]
            free = self._free()
            if free > 0:
                # A permit at hand (kept, drawable, claimable) starts it now, neither
                # queued nor held, and a pump has nothing to send for it before
                # next_request_at unless others wait on this key's reports. Held, every
                # such task would cost the event loop a pump.
                permit = client.admit_now(key, group, item)
                if permit is not None:
                    # Celery's strategy asked whether it was revoked a moment ago; a
                    # revoke by stamp raises in execute_using_pool, whose hook then
                    # releases the permit.
                    self._run(semaphore, request, permit, revoked=False)
                    # _waited_on first: no key is waited on unless it is (see on_reply).
                    if self._waited_on and client.waited_on(key):
                        self.hooks.wake(True)
                    return
            client.enqueue(key, group, item, enqueued_at=enqueued_at)
            # One more prefetch slot per held message keeps other work flowing. Past
            # the hold's limit the held message takes one of the pool's slots in the
            # prefetch window, and the broker sends work elsewhere.
            raised = self._may_raise(free)
            if raised:
                state.raised += 1
                self.hooks.qos_increment()
            state.held[item] = Held(request, semaphore, key, group, enqueued_at,
                                    self.clock(), raised)
            # A collecting pump asks the holder for it, unless a permit at hand or a full
            # pool is all it waits for: that pump would sweep every key for nothing. With
            # the pool full too, no pump is needed at all: the release that frees a slot
            # wakes one (a slot freed by work the gate did not admit: the timer's pump).
            # Under load that is nearly every arrival, and each saves a pump.
            collect = client.asks(key)
            # A task that ended in a pool thread just now found nothing held, so it woke
            # no pump (release): this one must, to start the request on its slot.
            if not collect and free <= 0 and not self._ended:
                return
        self.hooks.wake(collect)

    def _may_raise(self, free: int) -> bool:
        """Whether one more held message may raise prefetch: up to half of max_held while
        the pool is busy, so a busy worker leaves work to others; up to all of it while a
        pool slot is free that no held task can take. Without the second half, messages
        of keys waiting for a round would fill the prefetch window while the pool idled,
        and tasks whose keys had a permit at hand would wait in the broker behind them."""
        raised = self.state.raised
        if raised < self._busy_limit():
            return True
        return raised < self.max_held and free > 0

    def _busy_limit(self) -> int:
        return (self.max_held + 1) // 2

    def _admission_of(self, request: Any) -> tuple[str, str, str, str | None, float]:
        """The request's item (item_id), semaphore, key, group and enqueued-at time."""
        headers = request.request_dict
        semaphore = headers.get(HEADER_SEMAPHORE)
        key = headers.get(HEADER_KEY)
        enqueued_at = headers.get(HEADER_ENQUEUED_AT)
        if not isinstance(semaphore, str) or not isinstance(key, str):
            # Published without our headers (send_task by name from a producer
            # that lacks the task): recompute from the arguments.
            task = request.task
            admission = task.admission() if isinstance(task, AdmittedTask) else None
            if admission is None:
                raise DurabilityError(f"task {request.name} has no admission settings")
            semaphore = admission.semaphore
            key = admission.key_of(request.args, request.kwargs)
            group = admission.group_of(request.args, request.kwargs)
        else:
            group = headers.get(HEADER_GROUP)
        if semaphore not in self.clients:
            raise DurabilityError(f"unknown semaphore {semaphore!r} in task {request.id}")
        if group is not None and not isinstance(group, str):
            raise DurabilityError(f"group header of task {request.id} is not a str")
        if not isinstance(enqueued_at, int | float) or isinstance(enqueued_at, bool):
            enqueued_at = self.clock()
        return item_id(request, headers), semaphore, key, group, float(enqueued_at)

    def _refuse(self, request: Any, exc: Exception) -> None:
        """A request that can never be admitted: fail it loudly instead of running it ungated."""
        logger.error("durability: refusing task %s[%s]: %s", request.name, request.id, exc)
        try:
            request.task.backend.mark_as_failure(request.id, exc, request=request._context,
                                                 store_result=request.store_errors)
        except Exception:  # the result backend is optional; the refusal is not
            logger.exception("durability: could not record the refusal of %s", request.id)
        request.reject(requeue=False)
        worker_state.task_ready(request)

    # -- the pump (event-loop thread) ------------------------------------------

    def pump(self, *, collect: bool = True) -> list[Outgoing]:
        """Admit what permits allow. With `collect` (the timer's pumps, and wakes with news
        for the holder) also drop revoked and overdue held requests, and collect the
        messages due; sweeping every key for those is most of a pump's cost."""
        with self.lock:
            if self._ended and self._release_ended():
                collect = True  # a release others wait for: news for the holder
            if not collect:
                self._start_passed()
                self._admit()
                self._raise_for_idle_pool()
                if not self._return_unused():
                    return []
            now = self.clock()
            self._hand_back_overdue(now)
            self._drop_revoked()
            self._start_passed()
            self._admit()
            self._raise_for_idle_pool()
            self._return_unused()
            if self.state.held:  # slots came free, or soon-free ones changed hands
                for client in self.clients.values():
                    client.room_changed()
            if now >= self._next_watch:
                self._next_watch = now + WATCH_INTERVAL
                self._watch_holder()
            return self._collect_due()

    def _watch_holder(self) -> None:
        """Say once when a key's requests go unanswered while its tasks wait (no holder
        running, a holder that cannot reach its database), and forget hand-backs the
        broker has taken since."""
        self.state.let_go = [(request, at) for request, at in self.state.let_go
                             if not _acknowledged(request)]
        for name, client in self.clients.items():
            if not client.has_queued:
                continue
            for key, groups in client.held().items():
                error = client.last_error(key)
                if error is not None and (name, key) not in self._unanswered:
                    self._unanswered.add((name, key))
                    logger.warning(
                        "durability: no answer from the holder of %s/%s (%s) while %d "
                        "task(s) wait; is a holder running for it (celery -A proj worker "
                        "--durability-holder)?", name, key, error, sum(groups.values()))
                    if self.hooks.unanswered is not None:
                        self.hooks.unanswered(name, key)

    def _return_unused(self) -> bool:
        """Grant permits an admission left unclaimed beyond what the pool can start soon
        go back at once (SemaphoreClient.return_unused); True if any did."""
        returned = False
        for client in self.clients.values():
            returned = client.return_unused() or returned
        return returned

    def _raise_for_idle_pool(self) -> None:
        """A message held while the hold was at its limit raised no prefetch, and takes
        one of the pool's slots in the prefetch window. Raise for it once it may (see
        _may_raise): else, with a pool slot free that no held task can take, the broker
        sends nothing more while the pool idles."""
        state = self.state
        if len(state.held) == state.raised:
            return
        # The pool is read once: raising prefetch frees no slot.
        limit = self.max_held if self._free() > 0 else self._busy_limit()
        for entry in state.held.values():
            if state.raised >= limit:
                return
            if not entry.raised_qos:
                entry.raised_qos = True
                state.raised += 1
                self.hooks.qos_increment()

    def _hand_back_overdue(self, now: float) -> None:
        held = self.state.held
        for item in list(held):
            entry = held[item]
            if entry.held_since + self.hold_deadline > now:
                break  # held is in held_since order
            # Before the broker would redeliver it anyway (Redis visibility_timeout,
            # RabbitMQ consumer_timeout). Its enqueued-at header travels with it, so
            # when it comes back its demand is as old as before.
            self._unhold(item)
            logger.info("durability: handing task %s back to the broker after %.0fs held",
                        entry.request.id, now - entry.held_since)
            entry.request.reject(requeue=True)
            worker_state.task_ready(entry.request)
            message = getattr(entry.request, "message", None)
            if message is not None and not message.acknowledged:  # Celery logged why
                self.state.let_go.append((entry.request, now))

    def _drop_revoked(self) -> None:
        for item, entry in list(self.state.held.items()):
            request = entry.request
            if _revoked(request):
                self._unhold(item)  # revoked() acked it and marked it revoked

    def _unhold(self, item: str) -> Held:
        entry = self.state.held.pop(item)
        self.clients[entry.semaphore].cancel(item)
        if entry.raised_qos:
            self.state.raised -= 1
            self.hooks.qos_decrement()
        return entry

    def _start_passed(self) -> None:
        passed, self.state.passed = self.state.passed, []
        for semaphore, permit in passed:
            self._start(semaphore, permit)

    def _admit(self) -> None:
        if not self.state.held:
            return
        free = self._free()
        names = list(self.clients)
        self._turn = (self._turn + 1) % len(names)
        for name in names[self._turn:] + names[:self._turn]:
            if free <= 0:
                return
            client = self.clients[name]
            if not client.has_queued:
                continue  # every delivery comes here: skip the semaphores with no queue
            for permit in client.admit(limit=free):
                free -= self._start(name, permit)

    def _free(self) -> int:
        return self.hooks.pool_size() - len(self.state.running) - self.hooks.busy()

    def _start(self, semaphore: str, permit: Permit) -> int:
        entry = self.state.held.get(permit.item_id)
        if entry is None:  # cannot happen: every queued item is held
            self.clients[semaphore].release(permit.item_id)
            return 0
        del self.state.held[permit.item_id]
        if entry.raised_qos:
            self.state.raised -= 1
            self.hooks.qos_decrement()
        return self._run(semaphore, entry.request, permit, held_since=entry.held_since)

    def _run(self, semaphore: str, request: Any, permit: Permit, *,
             revoked: bool | None = None, held_since: float | None = None) -> int:
        """Hand an admitted request to the pool; 0 if it was revoked meanwhile (`revoked`:
        whether it is, if known; None asks). `held_since`: when it was held (None: never)."""
        if revoked or (revoked is None and _revoked(request)):
            # Never ran: its permit goes on to the next held task, as if it had ended.
            successor = self.clients[semaphore].pass_on(permit.item_id)
            return self._start(semaphore, successor) if successor else 0
        self.state.running[permit.item_id] = semaphore
        source = "handoff" if permit.handed_off else permit.source
        self.state.admitted_from[source] += 1
        if self.hooks.admitted is not None:
            held = 0.0 if held_since is None else self.clock() - held_since
            self.hooks.admitted(semaphore, permit.key, source, held)
        instrument(request, permit.item_id, self._release_hook)
        self.hooks.handoff(request)
        return 1

    # -- releases (any thread) ---------------------------------------------------

    def release(self, item: str) -> None:
        """An admitted task ended; repeated calls for one item do nothing.

        From a pool thread the item only joins `_ended`, and the event loop releases it
        before its next admission or pump, in order. The loop is woken when the release
        may start a held task, or may be news for the holder. Why: between a task's end
        and the next admission the worker runs Celery's own work, which leaves the caches
        cold, and there each line of the gate costs several times its warm figure
        (`python -m benchmarks.gate_cost --cold`). Released in the pool thread, the
        release and the admission after it each meet cold caches; released by the next
        admission on the loop, the second finds the key's bookkeeping warm, and pool
        threads never take the lock."""
        if threading.get_ident() != self.loop_thread:
            self._ended.append(item)
            if self._waited_on or self.state.held:
                self.hooks.wake(self._waited_on)
            return
        with self.lock:
            collect = self._release_ended() if self._ended else False
            semaphore = self.state.running.pop(item, None)
            start = False
            if semaphore is not None:
                successor, news = self._release_one(item, semaphore)
                collect = collect or news
                if successor is not None:
                    # On the event loop already (a prefork pool's results arrive there):
                    # the successor takes the freed slot now, with no pump in between; a
                    # pump is then needed only for another held request and another slot.
                    self._start(semaphore, successor)
                    start = bool(self.state.held) and self._free() > 0
                else:
                    start = bool(self.state.held)  # the freed slot may start one
            start = start or bool(self.state.passed)
        if collect or start:
            self.hooks.wake(collect)
        if self.hooks.run_deferred is not None:
            self.hooks.run_deferred()

    def _release_ended(self) -> bool:
        """Release the items that ended in pool threads (lock held). Their permits' successors
        join `passed`, for the caller (an admission, a pump) or a pump to start. True if
        a release is news for the holder."""
        news = False
        ended = self._ended
        while ended:
            item = ended.popleft()
            semaphore = self.state.running.pop(item, None)
            if semaphore is None:
                continue  # released already (the hooks of one ending may overlap)
            successor, collect = self._release_one(item, semaphore)
            if successor is not None:
                self.state.passed.append((semaphore, successor))
            news = news or collect
        return news

    def _release_one(self, item: str, semaphore: str) -> tuple[Permit | None, bool]:
        """Pass the permit of an ended item on, or release it (lock held): the successor's
        permit, if any, and whether this is news for the holder. A release is news only
        when others wait on it; otherwise it goes with the next report."""
        self.state.released += 1
        client = self.clients[semaphore]
        # Its key is asked about only while some key is waited on (see on_reply); read
        # before pass_on, which forgets the item.
        permit = client.permit(item) if self._waited_on else None
        successor = client.pass_on(item)
        if successor is None and self.state.held:
            return None, True  # the freed slot may need a permit for a held task: ask now
        return successor, permit is not None and client.waited_on(permit.key)

    # -- the holder ------------------------------------------------------------

    def _collect_due(self) -> list[Outgoing]:
        out = []
        for name, client in self.clients.items():
            for key in client.due():
                correlation_id = f"{self._correlation_prefix}-{next(self._correlation)}"
                # The client keeps which replies it awaits (SemaphoreClient.on_reply).
                body = client.message(key, correlation_id=correlation_id)
                out.append(Outgoing(name, key, correlation_id, body))
        return out

    def failed(self, message: Outgoing) -> None:
        """Publishing `message` failed: the client backs off and asks again."""
        with self.lock:
            self.clients[message.semaphore].unsent(message.key, message.correlation_id)

    def on_reply(self, correlation_id: str | None, body: object) -> bool:
        """A reply from a holder; False if it answers no message we still await."""
        with self.lock:
            self.settle_ended()  # the reply then meets the client as it stands
            match = next(((name, key) for name, client in self.clients.items()
                          if (key := client.on_reply(correlation_id, body)) is not None), None)
            if match is None:
                return False
            semaphore, key = match
            client = self.clients[semaphore]
            if (semaphore, key) in self._unanswered and client.last_error(key) is None:
                self._unanswered.discard((semaphore, key))
                logger.info("durability: the holder of %s/%s answers again", semaphore, key)
            self._waited_on = any(c.waited_on_any() for c in self.clients.values())
        self.hooks.wake(True)
        return True

    # -- shutdown and visibility ---------------------------------------------------

    def forget_held(self) -> list[tuple[Any, float]]:
        """The consumer stopped: held messages go back to the broker with the channel.

        Returns (request, since) of each, and of each hand-back the broker refused: a
        channel lost with its broker could not give them back, and `since` bounds the
        broker's unacked record of that delivery (GateStep gives them back later)."""
        with self.lock:
            self.settle_ended()  # their successors join `passed`, given back below
            forgotten = [(entry.request, entry.held_since)
                         for entry in self.state.held.values()] + self.state.let_go
            self.state.let_go = []
            for item, entry in list(self.state.held.items()):
                self.clients[entry.semaphore].cancel(item)
                worker_state.reserved_requests.discard(entry.request)
            self.state.held.clear()
            self.state.raised = 0
            # Permits passed on to held messages that are now gone go back to the holder.
            for semaphore, permit in self.state.passed:
                self.clients[semaphore].release(permit.item_id)
            self.state.passed.clear()
            # The clients still await their replies: they arrive on the reply queue,
            # which the restarted step (or the final report) consumes again.
            return forgotten

    def stop(self) -> None:
        """Warm shutdown: stop every lease so the final reports return undrawn permits."""
        with self.lock:
            self.settle_ended()
            for client in self.clients.values():
                client.stop()
            self._waited_on = True  # the final reports: every release is news

    def settled(self) -> bool:
        with self.lock:
            self.settle_ended()
            return not self.state.running and all(c.settled() for c in self.clients.values())

    def settle_ended(self) -> None:
        """Release what ended in pool threads now (lock held), for a caller about to read
        `state` or the clients; a started successor or news for the holder wakes a pump."""
        if self._ended and (self._release_ended() or self.state.passed):
            self.hooks.wake(True)
