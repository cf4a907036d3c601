# The consumer bootstep that puts the gate into a Celery worker: builds one
# SemaphoreClient per semaphore under a fresh client id, consumes the worker's
# reply queue, publishes request/sync messages to the holder queues on a
# connection of its own, and runs the gate's pump on the event loop's timer.
# Rule: everything that touches the broker here runs in the event-loop thread;
# pool threads only release.
from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import bootsteps
from kombu.common import ignore_errors
from kombu.messaging import Consumer, Producer

from ..client import SemaphoreClient
from ..compat import worker as celery_worker
from ..compat.pushes import RedisPushes, pushable
from ..metrics import served_by
from ..queues import reply_queue_declaration
from ..registry import Configuration
from ..roundtrip import publish_request
from ..semaphore import DurabilitySemaphore
from ..wire.routing import reply_queue, safe_queue_part
from .gate import Gate, Hooks, Outgoing, item_id
from .limits import DEFAULT_HOLD_DEADLINE, hold_deadline, warn_about_prefetch
from .plumbing import celery_requests
from .request import RELEASE_ATTRIBUTE
from .teardown import Orphan, give_back, guard_connection_loss, unreturned, watch_pops
from .visibility import log_summary, occupancy

logger = logging.getLogger("durability_celery.worker")

HELD_PER_SLOT = 8
"""Default max_held per pool slot; while the pool is busy the gate holds half of that
(Gate._may_raise). Every held task of a key without a permit waits for that key's next
round (1-3 s), so a worker serving many keys on grants alone runs at most about the
hold's size of tasks per round trip, and a full hold stops delivery for every key of the
worker's queues. Not larger: held messages are unacked, so a worker killed while
holding them returns them only after the broker's visibility_timeout, and a busy worker
would hold messages that another worker with free slots could have run."""
PUMP_INTERVAL = 0.05
"""Seconds between pumps when nothing wakes the gate earlier."""
HANDOFF_LINGER = 0.05
"""Seconds a permit whose task ended waits for the next task of its key, when nobody
else waits for the key as far as its last reply said (SemaphoreClient.handoff_linger).
Enough for a message already on its way here; longer, it strands the permit from a
worker whose request reached the holder after that reply."""
ROOMY_LINGER = 0.25
"""Seconds such a permit waits while its key's last reply said permits of the key and of
its group were still free: another worker's request is served from those, not from this
one. A worker taking in the tasks of many keys more slowly than one per key per
handoff_linger would give each permit back just before its key's next task came, and
that task would wait a round trip."""
CHAIN_BUDGET = 1.0
"""Seconds a solo worker runs admitted tasks back to back before Celery's loop turns
(GateStep.run_deferred). Handing each task to the loop's next turn instead cost up to a
pump interval per task; this costs that once a second at most."""
RESUME_DELAY = 0.01
"""Seconds from a chain's budget running out to its resumption (GateStep._resume_later)."""
SUMMARY_INTERVAL = 30.0
_PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1,
                  "interval_max": 0.2}

unadmitted_active: Callable[[], int] = partial(celery_worker.count_active_without,
                                              RELEASE_ATTRIBUTE)
"""Pool slots taken by requests the gate did not admit (admitted ones carry their
release hook, and the gate counts those itself). A partial, not a function that calls
it: the gate asks for every admission."""


class GateStep(bootsteps.ConsumerStep):  # type: ignore[misc]
    """Holds admitted-type task messages in the worker's main process until permitted."""

    name = "durability_celery.gate"
    requires = ("celery.worker.consumer:Connection", "celery.worker.consumer.tasks:Tasks")
    # Both set on the subclass `install` makes; `register_step` keeps this step for the
    # final report at shutdown.
    durability: Configuration
    register_step: Callable[[GateStep], None]

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        settings = self.durability.settings
        # A new id per start: a restarted worker is a new client and never
        # inherits (or corrupts) its predecessor's grants and leases.
        self.client_id = f"{c.hostname}/{secrets.token_hex(6)}"
        self.c = c
        self.clients = {
            name: self._client(name, semaphore) for name, semaphore
            in self.durability.semaphores.items()
        }
        self.reply_queue = reply_queue_declaration(
            reply_queue(settings.queue_prefix, safe_queue_part(self.client_id)),
            expires=settings.reply_expires)
        self._deferred: deque[Any] = deque()
        """Admitted requests of a solo pool, to run once the gate's call is done."""
        self._orphans: list[Orphan] = []
        """Messages let go of at the last stop, to give back at the next start."""
        metrics = served_by(getattr(c, "controller", None))
        self.metrics = metrics.worker() if metrics else None
        self.hooks = self._hooks(c)
        # Both are final in get_consumers, once the pool and the broker are known.
        self.gate = Gate(self.clients, self.hooks, max_held=settings.max_held or HELD_PER_SLOT,
                         hold_deadline=settings.hold_deadline or DEFAULT_HOLD_DEADLINE)
        if self.metrics is not None:
            self.metrics.watch(occupancy(self.gate), self.clients)
        self.producer: Any = None
        """Publishes to holders, on a connection of its own; built on first use."""
        self._pushes: RedisPushes | None = None
        """On Redis: pushes to holders by hand, on the producer's channel."""
        self._connection: Any = None
        self._pool_size = 0
        self._timers: list[Any] = []
        # Pool threads wake the loop as tasks end: the two flags change together under
        # this lock, so no wake's ask for a collecting pump is cleared unread.
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        self._collect_wanted = False
        self._running = False
        self._asleep = False
        """Started on a worker that consumes no task queue: the gate begins at its first
        wake (a task reached it after all), and not before."""
        self.began = False
        """The gate ran in this process: only then has it anything to report at shutdown."""
        self._running_deferred = False
        self._parked = False
        """A chain out of budget waits for the loop's next turn (_resume_later)."""
        # The strategy of AdmittedTask finds the gate here (strategy.py).
        c.durability_gate = self.gate
        c.durability_step = self
        guard_connection_loss(c)
        self.register_step(self)

    def _client(self, name: str, semaphore: DurabilitySemaphore) -> SemaphoreClient:
        config = semaphore.config
        # A permit whose task ended with nothing queued waits a moment for the next task
        # of its key and group (a full pool fetches it only as a task ends); no longer,
        # so that a key whose work is done reads free soon after.
        return self.durability.semaphore_client(
            name, client_id=self.client_id, handoff_window=semaphore.handoff_window,
            handoff_linger=min(HANDOFF_LINGER, config.round_wait),
            roomy_linger=min(ROOMY_LINGER, config.round_wait),
            # News sent by then reaches the holder within the round_wait it holds the
            # first request of a round for.
            supersede_after=config.round_wait / 2, supersede_demand=config.leases is None)

    def _hooks(self, c: Any) -> Hooks:
        self._real_handoff = celery_worker.pool_handoff(c)
        # solo runs the task inline, inside the handoff: it waits for run_deferred, so
        # that the gate's lock is released and a pump's messages are published first (a
        # claim must reach the holder before its deadline, however long the task).
        # Deferred through the loop's call_soon instead, the task ran on the loop's next
        # turn and Celery's ack of it on the turn after, past the loop's wait for the
        # broker: with a prefetch of 1 each task waited for the pump timer. Other pools
        # get Celery's own on_task_request, with nothing in between: it runs for every
        # admitted task.
        # (The consumer has its pool before its steps are made.)
        solo = celery_worker.runs_inline(c)

        def pool_size() -> int:
            # As _fit_pool last read it (every collecting pump): asked for every
            # admission, and reading the pool goes through two properties.
            return self._pool_size or self._read_pool_size()

        return Hooks(handoff=self._deferred.append if solo else self._real_handoff,
                     pool_size=pool_size, busy=unadmitted_active,
                     qos_increment=partial(celery_worker.raise_prefetch, c),
                     qos_decrement=partial(celery_worker.lower_prefetch, c),
                     wake=self._wake, requests=celery_requests(),
                     run_deferred=self.run_deferred if solo else None,
                     admitted=self.metrics.admitted if self.metrics else None,
                     unanswered=self.metrics.no_answer if self.metrics else None)

    def run_deferred(self) -> None:
        """Run a solo pool's admitted requests, oldest first. A task's end may defer the
        next one (its permit's successor): this loop runs it, so a chain stays flat.

        While it runs, Celery's loop does not turn: no ack of the tasks already run, no
        heartbeat, no broker I/O, and not the gate's pump timer. So after CHAIN_BUDGET
        seconds the chain hands the rest to the loop's next turn. Without the budget, a
        long chain would ack nothing and notice no broker restart until it ended."""
        if self._running_deferred or self._parked or not self._deferred:
            return
        self._running_deferred = True
        started = time.monotonic()
        try:
            while self._deferred:
                if time.monotonic() - started >= CHAIN_BUDGET:  # never before the first
                    self._resume_later()
                    break
                request = self._deferred.popleft()
                try:
                    self._real_handoff(request)
                except Exception:  # Celery handles a task's own errors; this is its bug
                    logger.exception("durability: starting task %s failed", request.id)
        finally:
            self._running_deferred = False

    def _resume_later(self) -> None:
        """Run the rest of a chain on the loop's next turn, after Celery's acks.

        Parked until then: the pump timer, due in the same turn, would otherwise run
        the chain on before the acks. A hub timer, not call_soon: the hub runs its
        call_soon callbacks (the acks of the tasks just run among them) in no set
        order, and its timers after them. Due a moment from now, not now: a timer due
        by the time the hub looks again fires in the same pass over the timers as the
        pump that may be running this chain."""
        self._parked = True
        celery_worker.call_later(self.c, RESUME_DELAY, self._resume)

    def _resume(self) -> None:
        self._parked = False
        self.run_deferred()

    # -- bootstep ----------------------------------------------------------------

    def get_consumers(self, channel: Any) -> list[Any]:
        self._fit_pool()
        self.gate.hold_deadline = hold_deadline(
            self.c.app, self.c.connection.transport.driver_type,
            self.durability.settings.hold_deadline)
        return [Consumer(  # type: ignore[no-untyped-call]
            channel, queues=[self.reply_queue], callbacks=[self._on_reply],
            no_ack=True, accept=["json"])]

    def start(self, c: Any) -> None:
        tasks_channel = celery_worker.task_channel(c)
        self._give_back(tasks_channel)
        watch_pops(tasks_channel, self._unrecorded)
        self.gate.loop_thread = threading.get_ident()
        # The control queue carries beat's and reconcile's plain tasks alone: a worker
        # consuming nothing else (a holder as deployed) is never sent an admitted task,
        # so its gate neither consumes a reply queue nor runs a pump timer until one is.
        if not celery_worker.task_queue_names(c) - {self.durability.control_queue}:
            self.consumers = None
            self._asleep = True
            logger.info("durability: gate idle: this worker consumes no task queue")
            return
        self._begin(c)
        warn_about_prefetch(c.app.conf)

    def _begin(self, c: Any) -> None:
        super().start(c)
        self._asleep = False
        self.began = True
        self._running = True
        self._timers = [c.timer.call_repeatedly(PUMP_INTERVAL, self.pump),
                        c.timer.call_repeatedly(SUMMARY_INTERVAL, log_summary, (self.gate,))]
        logger.info("durability: gate started as client %s (hold deadline %.0fs, max held %d)",
                    self.client_id, self.gate.hold_deadline, self.gate.max_held)

    def stop(self, c: Any) -> None:
        self._close_gate()
        self._close_consumers(c, cancel=True)

    def shutdown(self, c: Any) -> None:
        self._close_gate()
        self._close_consumers(c, cancel=False)

    def _close_consumers(self, c: Any, *, cancel: bool) -> None:
        """ConsumerStep's stop (`cancel`) or shutdown. When a lost broker connection makes
        Celery restart its steps it has dropped `c.connection` already, and its own close
        names the errors to ignore through it: a channel close failing on the dead broker
        raised AttributeError ("Error on restarting GateStep"). The channels are dead
        with their connection then, whatever their close raises."""
        if c.connection is not None:
            (super().stop if cancel else super().shutdown)(c)
            return
        consumers: list[Any] = self.consumers or []
        for consumer in consumers:
            if cancel:
                with contextlib.suppress(Exception):
                    consumer.cancel()
            with contextlib.suppress(Exception):
                consumer.channel.close()

    def _close_gate(self) -> None:
        self._running = False  # a wake already scheduled must not publish on a closed channel
        self._asleep = False
        for entry in self._timers:
            entry.cancel()
        self._timers = []
        now = time.time()
        forgotten = self.gate.forget_held()
        if forgotten:
            logger.info("durability: %d held message(s) go back to the broker", len(forgotten))
        self._orphans += [Orphan(request.message, since) for request, since in forgotten]
        self._orphans += [Orphan(request.message, now) for request in self._deferred]
        # Admitted but never started (a solo pool's shutdown stops a running task, and
        # the tasks deferred behind it with it): their permits go back now, their
        # messages with the channel. The flag keeps release from running them; it is
        # cleared after, since a lost broker connection stops this step and starts it
        # again (left set, a solo worker ran no admitted task after a reconnect).
        self._running_deferred = True
        try:
            while self._deferred:
                request = self._deferred.popleft()
                celery_worker.forget_reserved(request)
                self.gate.release(item_id(request, self.hooks.requests.headers(request)))
        finally:
            self._running_deferred = False
            self._parked = False  # a resume still scheduled finds nothing to run
        self._drop_producer()

    def _give_back(self, channel: Any) -> None:
        """Messages the last stop let go of that the lost channel could not return go
        back now, over the new connection's task channel (teardown.give_back)."""
        orphans, self._orphans = unreturned(self._orphans), []
        if not orphans:
            return
        try:
            count = give_back(channel, orphans)
        except Exception as exc:  # the broker is gone again: the next start tries again
            self._orphans = orphans
            logger.warning("durability: could not give back %d message(s) held when the "
                           "broker connection was lost: %r", len(orphans), exc)
            return
        logger.info("durability: gave back %d of %d message(s) held when the broker "
                    "connection was lost", count, len(orphans))

    def _unrecorded(self, message: Any, when: float) -> None:
        logger.warning("durability: message %s was taken from the broker as it failed; "
                       "it goes back at the next start", message.delivery_tag)
        self._orphans.append(Orphan(message, when, unrecorded=True))

    # -- the loop --------------------------------------------------------------

    def _wake(self, collect: bool) -> None:
        with self._wake_lock:
            self._collect_wanted = self._collect_wanted or collect
            if self._wake_pending:
                return  # a pump is already scheduled; it reads the flag when it runs
            self._wake_pending = True
        celery_worker.call_soon(self.c, self._woken)

    def _woken(self) -> None:
        self.pump(collect=False)  # collects anyway if a wake since the last pump asked

    def _fit_pool(self) -> None:
        """Ask for no permit the pool could not run, and hold what it can use soon. The
        size is read on every collecting pump (the timer's, every PUMP_INTERVAL, and
        wakes with news for the holder): an autoscaled pool (`--autoscale`) grows as held
        tasks wait (they count as reserved), and with the size it started at, demand
        stayed at its minimum whatever it grew to."""
        size = self._read_pool_size()
        if size == self._pool_size:
            return
        with self.gate.lock:
            self._pool_size = size
            if self.durability.settings.max_held is None:
                self.gate.max_held = HELD_PER_SLOT * size
            for client in self.clients.values():
                client.capacity = size

    def _read_pool_size(self) -> int:
        return celery_worker.pool_size(self.c)

    def pump(self, *, collect: bool = True) -> None:
        """The timer's pump collects messages; a wake's only if a wake asked it to."""
        with self._wake_lock:
            self._wake_pending = False
            collect = collect or self._collect_wanted
            self._collect_wanted = False
        if not self._running:
            if not self._asleep:
                return
            self._begin(self.c)  # a task reached a gate that slept: a queue was added
        try:
            if collect:
                self._fit_pool()
            for message in self.gate.pump(collect=collect):
                self._publish(message)
        except Exception:  # the timer must keep running whatever one pump hits
            logger.exception("durability: gate pump failed")
        self.run_deferred()

    def _publish(self, message: Outgoing) -> None:
        try:
            self._send(message)
        except Exception as exc:
            logger.warning("durability: sending to holder of %s/%s failed (the next message "
                           "opens a new connection): %r", message.semaphore, message.key, exc)
            self._drop_producer()
            self.gate.failed(message)

    def _send(self, message: Outgoing) -> None:
        queue = self.durability.queue_for(message.semaphore, message.key)
        producer = self.producer or self._open_producer()
        pushes = self._pushes
        if pushes is None:
            publish_request(producer, queue, message.body, reply_to=self.reply_queue.name,
                            correlation_id=message.correlation_id, retry_policy=_PUBLISH_RETRY)
            return
        # No retry here: a failed push fails the message, whose client asks again after
        # its backoff, on the new connection the next message opens.
        pushes.add(queue, message.body, correlation_id=message.correlation_id,
                   reply_to=self.reply_queue.name)
        pushes.send()

    def _open_producer(self) -> Any:
        """A producer on a broker connection of the step's own, as Celery's event
        dispatcher has one (consumer/events.py).

        Not the worker's consumer connection: kombu's retry (`Connection.ensure`)
        collects the connection it publishes on, so a publish that met a dead broker
        there would end the worker's consumption while Celery, whose loop saw no error,
        restarted nothing. On a connection of its own, the retry collects only that;
        Celery sees its own connection fail and restarts the consumer. No heartbeats:
        nothing reads this connection; one that died idle is reconnected by its next
        publish's retry (a push: by redis-py, which checks a pooled connection before it
        lends it), or dropped (`_drop_producer`) for a new one. Connecting retries
        as a publish does: kombu's default for a channel's connection sleeps 2 s between
        attempts, on the event loop, and the gate asks again after a failure anyway.

        On Redis the step pushes its messages itself (compat.pushes), as the holder does
        its replies: kombu's publish costs the event loop more than the push it ends in,
        for every message to a holder."""
        self._connection = self.c.app.connection_for_write(heartbeat=0)
        self._connection.ensure_connection(**_PUBLISH_RETRY)
        self.producer = Producer(  # type: ignore[no-untyped-call]
            self._connection.channel(), serializer="json")
        channel = self.producer.channel
        self._pushes = RedisPushes(channel) if pushable(self._connection, channel) else None
        return self.producer

    def _drop_producer(self) -> None:
        connection, self._connection, self.producer = self._connection, None, None
        self._pushes = None
        if connection is not None:
            ignore_errors(connection, connection.release)  # type: ignore[no-untyped-call]

    def _on_reply(self, body: Any, message: Any) -> None:
        correlation_id = message.properties.get("correlation_id")
        if not self.gate.on_reply(correlation_id, body):
            logger.debug("durability: dropped late reply %s", correlation_id)
