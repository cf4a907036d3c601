# Leaked-permit reconciliation, beyond the spec: a client that no holder has
# heard from for `reconcile_after` seconds AND that no live worker claims (its
# node does not answer, or answers with other client ids: it restarted) is
# settled, so a crashed worker does not shrink a budget forever. Rule: silence
# alone never settles anyone (a long task on a grant sends no reports), and a
# client heard from again before the settle commits is left alone.
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from celery.worker.control import inspect_command

from .core.clients import Forgotten
from .errors import ConfigurationError, DurabilityError

if TYPE_CHECKING:
    from .registry import Configuration

RECONCILE_TASK = "durability_celery.reconcile"
SCHEDULE_NAME = "durability_celery.reconcile"
ASK_TIMEOUT = 2.0
ASK_ATTEMPTS = 2
"""A node counts as silent only if it answers none of these inspect broadcasts."""

logger = logging.getLogger(__name__)

Answers = dict[str, set[str]]
"""node name -> client ids its gate reports, for the nodes that answered."""


@inspect_command()  # type: ignore[untyped-decorator]
def durability_clients(state: Any) -> dict[str, Any]:
    """The client ids of this worker's gate (one per semaphore, one incarnation)."""
    gate = getattr(state.consumer, "durability_gate", None)
    if gate is None:
        return {"client_ids": []}
    return {"client_ids": sorted({client.client_id for client in gate.clients.values()})}


def node_of(client_id: str) -> str:
    """The Celery node name inside a gate's client id (`node/incarnation`)."""
    return client_id.rsplit("/", 1)[0]


def confirmed_gone(client_id: str, answers: Answers) -> bool:
    """Gone: its node did not answer, or answered without this client id (it restarted)."""
    node = node_of(client_id)
    return node not in answers or client_id not in answers[node]


def ask_nodes(app: Any, nodes: Iterable[str], *, timeout: float = ASK_TIMEOUT,
              attempts: int = ASK_ATTEMPTS) -> Answers:
    """Ask `nodes` for their client ids; a node that answers any attempt counts as answering."""
    answers: Answers = {}
    pending = sorted(set(nodes))
    for _ in range(attempts):
        if not pending:
            break
        replies = app.control.broadcast("durability_clients", destination=pending, reply=True,
                                        timeout=timeout, limit=len(pending))
        for answer in replies or []:
            for node, reply in answer.items():
                if isinstance(reply, dict):
                    answers[node] = set(reply.get("client_ids", []))
        pending = [node for node in pending if node not in answers]
    return answers


def reconcile(durability: Configuration, *,
              ask: Callable[[Iterable[str]], Answers] | None = None) -> list[Forgotten]:
    """One pass over every semaphore: settle silent clients confirmed gone."""
    silent_for = durability.settings.reconcile_after
    if silent_for is None:
        return []
    asker = ask or (lambda nodes: ask_nodes(durability.app, nodes))
    settled: list[Forgotten] = []
    for sem in durability.semaphores.values():
        try:
            silent = sem.silent_clients(silent_for=silent_for)
        except DurabilityError as exc:
            logger.error("reconcile: cannot list silent clients of %r: %s", sem.name, exc)
            continue
        if not silent:
            continue
        answers = asker({node_of(client_id) for client_id in silent})
        for client_id, keys in silent.items():
            if not confirmed_gone(client_id, answers):
                continue
            settled += _forget(sem, client_id, keys, silent_for)
    return settled


def _forget(sem: Any, client_id: str, keys: list[str], silent_for: float) -> list[Forgotten]:
    done = []
    for key in keys:
        try:
            forgotten = sem.forget_client(key, client_id, silent_for=silent_for)
        except DurabilityError as exc:
            logger.error("reconcile: %r key %r client %r failed: %s", sem.name, key,
                         client_id, exc)
            continue
        if forgotten is not None:
            logger.warning(
                "reconcile: settled gone client %s on %s/%s: %d grant(s), %d lease(s), "
                "%d permit(s) freed", client_id, sem.name, key, forgotten.grants,
                forgotten.leases, forgotten.permits)
            done.append(forgotten)
    return done


def install(durability: Configuration) -> None:
    """Schedule reconciliation on the control queue when `reconcile_after` is set."""
    settings = durability.settings
    if settings.reconcile_after is None:
        return
    app = durability.app
    transport = app.connection_for_read().transport
    if "fanout" not in transport.implements.exchange_type:
        raise ConfigurationError(
            "reconcile_after needs a broker with broadcast (fanout) support to ask workers "
            f"whether they are alive; {transport.driver_name!r} has none"
        )

    def run() -> int:
        return len(reconcile(durability))

    task: Any = app.task(name=RECONCILE_TASK, ignore_result=True, shared=False)(run)
    app.add_periodic_task(
        settings.reconcile_interval, task.s(), name=SCHEDULE_NAME,
        queue=durability.control_queue, expires=settings.reconcile_interval,
        ignore_result=True,
    )
