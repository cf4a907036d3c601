# What the gate can tell about itself: held and running counts per semaphore,
# key and group, with the blocked reason of the last reply, for the
# `durability_held` remote-control command and the periodic log line. Rule:
# read-only, under the gate's lock, JSON-ready.
from __future__ import annotations

import logging
from typing import Any

from celery.worker.control import inspect_command

from .gate import Gate

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


def log_summary(gate: Gate) -> None:
    """One log line per waiting (semaphore, key, group), while anything is held."""
    summary = describe(gate)
    for row in summary["keys"]:
        if row["held"]:
            logger.info(
                "durability: %s/%s group=%s held=%d running=%d blocked=%s oldest_wait=%ss",
                row["semaphore"], row["key"], row["group"], row["held"], row["running"],
                row["blocked"] or row["error"] or "-", row["oldest_wait"])


@inspect_command()  # type: ignore[untyped-decorator]
def durability_held(state: Any) -> dict[str, Any]:
    """Held and running admitted tasks per semaphore, key and group, with blocked reasons."""
    gate = getattr(state.consumer, "durability_gate", None)
    if gate is None:
        return {"error": "no durability gate in this worker"}
    return describe(gate)
