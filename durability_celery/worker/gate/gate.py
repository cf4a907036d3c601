# The gate: one worker's client queue. Admitted-type requests wait here, in the
# main process, unacked and outside the pool, until a SemaphoreClient gives them
# a permit; then they go to the pool, and their ending releases the permit.
# Rules: a permit is taken only while the pool has a free slot (never spent
# waiting); each admitted task ends exactly once (by item, idempotent), and its
# permit is then released or passed on to the next held task of its key and
# group (SemaphoreClient.pass_on); one lock serializes every SemaphoreClient
# call. A task that ends in a pool thread is released by the event loop, before
# its next admission or pump. Policy only: Celery is reached through `Hooks`
# (model.py), which the consumer step builds; the hold and the holder's side
# are the base classes Hold (hold.py) and HolderTalk (holder.py).
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ...client import Permit, SemaphoreClient
from ...errors import DurabilityError
from .hold import Hold
from .holder import HolderTalk
from .model import GateState, Held, Hooks, Outgoing, admission_of

logger = logging.getLogger("durability_celery.worker")

WATCH_INTERVAL = 1.0
"""Seconds between two looks for keys whose holder does not answer."""


class Gate(Hold, HolderTalk):
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
            item, semaphore, key, group, enqueued_at = admission_of(
                request, self.hooks.requests, self.clients, self.clock)
        except DurabilityError as exc:
            # Never admissible: failed loudly instead of running ungated.
            self.hooks.requests.refuse(request, exc)
            return
        with self.lock:
            if self._ended:
                self._release_ended()  # their slots and permits may serve this request
            if self._duplicate(item, request):
                return
            # Passed-on permits start first: their tasks were admitted earlier; then held
            # tasks that a pool slot freed since the last pump lets start.
            if self.state.passed:
                self._start_passed()
            if self.state.held:
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
            self._hold(Held(request, semaphore, key, group, enqueued_at, self.clock(), False),
                       item, free)
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

    def _duplicate(self, item: str, request: Any) -> bool:
        """A delivery of a task already held or running: True once handled."""
        state = self.state
        previous = state.held.pop(item, None)
        if previous is not None:
            # Redelivered while held: keep the newer delivery (the broker's unacked
            # record now belongs to it) and restart its hold clock.
            self.hooks.requests.forget(previous.request)
            previous.request, previous.held_since = request, self.clock()
            state.held[item] = previous
            return True
        if item in state.running:
            logger.warning("durability: duplicate delivery of running task %s dropped",
                           request.id)
            self.hooks.requests.drop(request)
            return True
        return False

    def _hold(self, held: Held, item: str, free: int) -> None:
        """Queue the request in its client and hold its message until a permit comes."""
        self.clients[held.semaphore].enqueue(held.key, held.group, item,
                                             enqueued_at=held.enqueued_at)
        # One more prefetch slot per held message keeps other work flowing. Past the
        # hold's limit the held message takes one of the pool's slots in the prefetch
        # window, and the broker sends work elsewhere.
        held.raised_qos = self._may_raise(free)
        if held.raised_qos:
            self.state.raised += 1
            self.hooks.qos_increment()
        self.state.held[item] = held

    # -- the pump (event-loop thread) ------------------------------------------

    def pump(self, *, collect: bool = True) -> list[Outgoing]:
        """Admit what permits allow. With `collect` (the timer's pumps, and wakes with news
        for the holder) also drop revoked and overdue held requests, and collect the
        messages due; sweeping every key for those is most of a pump's cost. A pump
        without `collect` collects too if it leaves a slot free with tasks held."""
        with self.lock:
            if self._ended and self._release_ended():
                collect = True  # a release others wait for: news for the holder
            if not collect:
                self._start_passed()
                self._admit()
                self._raise_for_idle_pool()
                # A slot still free with tasks held: permits at hand could not start
                # them, so the holder is asked for theirs now, not at the timer's pump.
                if not self._return_unused() and not (self.state.held and self._free() > 0):
                    return []
            now = self.clock()
            self._hand_back_overdue(now)
            self._drop_revoked()
            self._start_passed()
            self._admit()
            self._raise_for_idle_pool()
            self._return_unused()
            self._hand_back_crowded_out()
            self._shed_excess(now)
            if self.state.held:  # slots came free, or soon-free ones changed hands
                for client in self.clients.values():
                    client.room_changed()
            if now >= self._next_watch:
                self._next_watch = now + WATCH_INTERVAL
                self._watch_holder()
            return self._collect_due()

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
        if revoked or (revoked is None and self.hooks.requests.revoked(request)):
            # Never ran: its permit goes on to the next held task, as if it had ended.
            successor = self.clients[semaphore].pass_on(permit.item_id)
            return self._start(semaphore, successor) if successor else 0
        self.state.running[permit.item_id] = semaphore
        source = "handoff" if permit.handed_off else permit.source
        self.state.admitted_from[source] += 1
        if self.hooks.admitted is not None:
            held = 0.0 if held_since is None else self.clock() - held_since
            self.hooks.admitted(semaphore, permit.key, source, held)
        self.hooks.requests.instrument(request, permit.item_id, self._release_hook)
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
        # A freed slot with tasks held is no news by itself: the pump it wakes asks the
        # holder only if no permit at hand starts one there (pump).
        return successor, permit is not None and client.waited_on(permit.key)

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
