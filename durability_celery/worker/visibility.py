# What the gate can tell about itself: held and running counts per semaphore,
# key and group, with the blocked reason of the last reply, for the
# `durability_held` remote-control command and the periodic log line; and the
# permits it holds per key, as it has reported them, for `durability_permits`;
# and one task's place in the gate, for `durability_task` and `durability_ahead`
# (what `durability-celery why` asks). Rule: read-only, under the gate's lock,
# JSON-ready.
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from celery.worker.control import inspect_command

from ..client import SemaphoreClient
from ..client.ledger import KeyLedger
from ..compat import worker as celery_worker
from .gate import Gate, Held

logger = logging.getLogger("durability_celery.worker")


def describe(gate: Gate) -> dict[str, Any]:
    """Rows of (semaphore, key, group) with held and running counts and why they wait."""
    now = gate.clock()
    with gate.lock:
        gate.settle_ended()
        oldest: dict[tuple[str, str, str | None], float] = {}
        for entry in gate.state.held.values():
            where = (entry.semaphore, entry.key, entry.group)
            oldest[where] = min(oldest.get(where, entry.enqueued_at), entry.enqueued_at)
        rows = []
        for name, client in gate.clients.items():
            held, running = client.held(), client.running()
            for key in sorted(set(held) | set(running)):
                groups = set(held.get(key, {})) | set(running.get(key, {}))
                for group in sorted(groups, key=lambda g: (g is not None, g or "")):
                    since = oldest.get((name, key, group))
                    rows.append({
                        "semaphore": name, "key": key, "group": group,
                        "held": held.get(key, {}).get(group, 0),
                        "running": running.get(key, {}).get(group, 0),
                        "blocked": client.blocked_reason(key, group),
                        "error": client.last_error(key),
                        "oldest_wait": None if since is None else round(now - since, 3),
                    })
        return {"held": len(gate.state.held), "running": len(gate.state.running),
                "raised": gate.state.raised,
                "max_held": gate.max_held, "hold_deadline": gate.hold_deadline,
                "admitted_from": dict(gate.state.admitted_from),
                "released": gate.state.released,
                "keys": rows}


def occupancy(gate: Gate) -> Callable[[], list[tuple[str, str, int, int]]]:
    """(semaphore, key, held, running) of each key the gate holds or runs tasks of, for
    the metrics' gauges. Read under the lock, from the metrics server's thread: tasks
    ended in pool threads count as running until the event loop releases them (at its
    next pump)."""
    def read() -> list[tuple[str, str, int, int]]:
        rows = []
        with gate.lock:
            for name, client in gate.clients.items():
                held, running = client.held(), client.running()
                for key in set(held) | set(running):
                    rows.append((name, key, sum(held.get(key, {}).values()),
                                 sum(running.get(key, {}).values())))
        return rows

    return read


def log_summary(gate: Gate) -> None:
    """One log line per waiting (semaphore, key, group), while anything is held."""
    summary = describe(gate)
    for row in summary["keys"]:
        if row["held"]:
            logger.info(
                "durability: %s/%s group=%s held=%d running=%d blocked=%s oldest_wait=%ss",
                row["semaphore"], row["key"], row["group"], row["held"], row["running"],
                row["blocked"] or row["error"] or "-", row["oldest_wait"])


def _seconds(at: float, now: float) -> float | None:
    """`at` in seconds from now (negative: past), None for never."""
    return None if math.isinf(at) else round(at - now, 3)


def _next_request_in(ledger: KeyLedger, now: float) -> float | None:
    """When the next report is due; None before the first reply, whose next_request_at
    is still the ledger's 0.0 (shown as minus the epoch otherwise)."""
    at = ledger.schedule.next_request_at
    return None if at <= 0 else _seconds(at, now)


def _key_permits(client: SemaphoreClient, key: str, ledger: KeyLedger,
                 now: float) -> dict[str, Any]:
    """One key's grants and leases as this worker holds them: the counts it has (claimed,
    drawn, released) next to what the holder acknowledged of them (`reported`)."""
    grants = [{"grant_id": g.grant_id, "group": g.group, "permits": g.permits,
               "claimed": g.claimed, "released": g.released,
               "reported": [g.acked_claimed, g.acked_released],
               "claim_deadline_in": _seconds(g.claim_deadline, now), "expired": g.expired}
              for g in ledger.grants.values()]
    leases = [{"lease_id": le.lease_id, "group": le.group, "permits": le.permits,
               "drawn": le.drawn, "released": le.released,
               "reported": [le.acked_drawn, le.acked_released],
               "expires_in": _seconds(le.expires_at, now), "stopped": le.stopped,
               "retired": le.retired}
              for le in ledger.leases.values()]
    in_flight = ledger.schedule.in_flight
    return {"semaphore": client.semaphore, "key": key, "grants": grants, "leases": leases,
            "kept_idle": [{"group": group, "permits": count}
                          for group, count in client.kept_idle(key).items()],
            "contended": ledger.contended, "over_limit": ledger.over_limit,
            "next_request_in": _next_request_in(ledger, now),
            "waiting_for_reply": None if in_flight is None else round(now - in_flight.sent_at, 3),
            "error": ledger.schedule.last_error}


def describe_permits(gate: Gate) -> dict[str, Any]:
    """Per (semaphore, key) this worker has talked to the holder about: its grants and
    leases, the permits it keeps idle, and when it next reports."""
    now = gate.clock()
    with gate.lock:
        gate.settle_ended()
        keys = [_key_permits(client, key, ledger, now)
                for client in gate.clients.values()
                for key, ledger in sorted(client.ledgers().items())]
        return {"client_id": next((c.client_id for c in gate.clients.values()), None),
                "keys": keys}


@inspect_command()  # type: ignore[untyped-decorator]
def durability_permits(state: Any) -> dict[str, Any]:
    """Grants and leases this worker holds per semaphore and key, with what it reported."""
    return _of_gate(state, describe_permits)


@inspect_command()  # type: ignore[untyped-decorator]
def durability_held(state: Any) -> dict[str, Any]:
    """Held and running admitted tasks per semaphore, key and group, with blocked reasons."""
    return _of_gate(state, describe)


def _held_facts(gate: Gate, item: str, entry: Held, now: float) -> dict[str, Any]:
    """What a held task waits for, as this worker knows it: the blocked reason and error of
    its key's last reply, the report in flight, the pool's free slots, and its place among
    the tasks of its key and group held here (oldest first, as the client admits them)."""
    client = gate.clients[entry.semaphore]
    ledger = client.ledgers().get(entry.key)
    in_flight = ledger.schedule.in_flight if ledger is not None else None
    mine = (entry.enqueued_at, item)
    ahead = sum(1 for other, held in gate.state.held.items()
                if (held.semaphore, held.key, held.group) == (entry.semaphore, entry.key,
                                                               entry.group)
                and (held.enqueued_at, other) < mine)
    return {
        "item": item, "semaphore": entry.semaphore, "key": entry.key, "group": entry.group,
        "enqueued_at": entry.enqueued_at, "held_for": round(now - entry.held_since, 3),
        "ahead_here": ahead, "blocked": client.blocked_reason(entry.key, entry.group),
        "error": client.last_error(entry.key),
        "waiting_for_reply": None if in_flight is None else round(now - in_flight.sent_at, 3),
        "next_request_in": None if ledger is None else _next_request_in(ledger, now),
        "free_slots": gate.hooks.pool_size() - len(gate.state.running) - gate.hooks.busy(),
    }


def find_task(gate: Gate, task_id: str) -> dict[str, Any]:
    """Where this worker has `task_id`: held by the gate (and why), running on a permit,
    reserved or running outside the gate (not an admitted task), or not at all."""
    now = gate.clock()
    with gate.lock:
        gate.settle_ended()
        for item, entry in gate.state.held.items():
            if entry.request.id == task_id:
                return {"state": "held", **_held_facts(gate, item, entry, now)}
        for item, semaphore in gate.state.running.items():
            permit = (gate.clients[semaphore].permit(item)
                      if item.rsplit("#", 1)[0] == task_id else None)
            if permit is not None:
                return {"state": "running", "item": item, "semaphore": semaphore,
                        "key": permit.key, "group": permit.group, "source": permit.source,
                        "running_for": round(now - permit.started, 3)}
    known = celery_worker.request_state(task_id)
    if known is not None:
        return {"state": known[0], "task": known[1]}
    return {"state": None}


def count_ahead(gate: Gate, semaphore: str, key: str, before: float) -> dict[str, Any]:
    """Per group of (semaphore, key): the tasks held here enqueued before `before`, all
    those held here, and those running here."""
    counts: dict[str | None, list[int]] = {}
    with gate.lock:
        gate.settle_ended()
        for entry in gate.state.held.values():
            if (entry.semaphore, entry.key) == (semaphore, key):
                row = counts.setdefault(entry.group, [0, 0, 0])
                row[0] += entry.enqueued_at < before
                row[1] += 1
        client = gate.clients.get(semaphore)
        running = client.running().get(key, {}) if client is not None else {}
        for group, count in running.items():
            counts.setdefault(group, [0, 0, 0])[2] = count
    return {"groups": [{"group": group, "ahead": ahead, "held": held, "running": run}
                       for group, (ahead, held, run) in counts.items()]}


@inspect_command(args=[("task_id", str)], signature="<task_id>")  # type: ignore[untyped-decorator]
def durability_task(state: Any, task_id: str) -> dict[str, Any]:
    """Where this worker has one task: held by the gate (and why), running, or not here."""
    return _of_gate(state, lambda gate: find_task(gate, task_id))


@inspect_command(  # type: ignore[untyped-decorator]
    args=[("semaphore", str), ("key", str), ("before", float)],
    signature="<semaphore> <key> <before>")
def durability_ahead(state: Any, semaphore: str, key: str, before: float) -> dict[str, Any]:
    """Per group of one key: tasks held here enqueued before `before` (epoch seconds)."""
    return _of_gate(state, lambda gate: count_ahead(gate, semaphore, key, float(before)))


def _of_gate(state: Any, view: Callable[[Gate], dict[str, Any]]) -> dict[str, Any]:
    """`view` of the worker's gate; an error for a worker without one (the holder)."""
    gate = getattr(state.consumer, "durability_gate", None)
    if gate is None:
        return {"error": "no durability gate in this worker"}
    return view(gate)
