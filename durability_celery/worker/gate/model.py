# What the gate's policy works with: the held and in-flight records, its state,
# and the hooks through which it reaches the worker and Celery's requests. Rule:
# no Celery or kombu import anywhere in gate/ (an import-linter contract); a
# request is an opaque object the hooks act on, except for its task `id`.
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...client import Permit, SemaphoreClient
from ...errors import DurabilityError
from ..headers import HEADER_ENQUEUED_AT, HEADER_GROUP, HEADER_KEY, HEADER_SEMAPHORE


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
class Requests:
    """What the gate asks of a Celery request (worker/plumbing.py builds them)."""

    headers: Callable[[Any], Mapping[str, Any]]
    """The request's message headers (its `request_dict`)."""
    admission: Callable[[Any], tuple[str, str, str | None]]
    """(semaphore, key, group) recomputed from the task's arguments, for a message
    published without the headers; raises DurabilityError if the task has none."""
    revoked: Callable[[Any], bool]
    """Whether it was revoked (acking and marking it so if it was)."""
    instrument: Callable[[Any, str, Callable[[str], object]], None]
    """(request, item, release): make every ending of the request call release(item)."""
    drop: Callable[[Any], None]
    """Ack a duplicate delivery of a running task and forget it."""
    hand_back: Callable[[Any], bool]
    """Requeue a held request's message; False if the broker refused it (not acked)."""
    refuse: Callable[[Any, Exception], None]
    """Fail a request that can never be admitted, and drop its message."""
    acknowledged: Callable[[Any], bool]
    """Whether the broker has taken its message (a hand-back that went through late)."""
    forget: Callable[[Any], None]
    """Forget a request the gate let go of without an ending (replaced, or stopped)."""


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
    requests: Requests
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


def item_id(request: Any, headers: Mapping[str, Any]) -> str:
    """The client-queue item of one delivery: the task id plus its retry count.

    A retry is a new message with the same task id that may arrive before the
    attempt that sent it has released; it must queue for its own permit, while
    a redelivery of the same attempt must not. `headers`: the request's headers
    (Requests.headers)."""
    return f"{request.id}#{headers.get('retries') or 0}"


def admission_of(request: Any, requests: Requests, clients: Mapping[str, SemaphoreClient],
                 now: Callable[[], float]) -> tuple[str, str, str, str | None, float]:
    """The request's item (item_id), semaphore, key, group and enqueued-at time; raises
    DurabilityError for a request that can never be admitted."""
    headers = requests.headers(request)
    semaphore = headers.get(HEADER_SEMAPHORE)
    key = headers.get(HEADER_KEY)
    enqueued_at = headers.get(HEADER_ENQUEUED_AT)
    if not isinstance(semaphore, str) or not isinstance(key, str):
        # Published without our headers (send_task by name from a producer
        # that lacks the task): recompute from the arguments.
        semaphore, key, group = requests.admission(request)
    else:
        group = headers.get(HEADER_GROUP)
    if semaphore not in clients:
        raise DurabilityError(f"unknown semaphore {semaphore!r} in task {request.id}")
    if group is not None and not isinstance(group, str):
        raise DurabilityError(f"group header of task {request.id} is not a str")
    if not isinstance(enqueued_at, int | float) or isinstance(enqueued_at, bool):
        enqueued_at = now()
    return item_id(request, headers), semaphore, key, group, float(enqueued_at)
