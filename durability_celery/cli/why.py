# `durability-celery why TASK_ID`: where one task is and, if a worker's gate holds
# it, why it waits: its semaphore, key and group, the reason (the blocked reason
# the holder's last reply gave its worker, else what the worker itself waits
# for), how many tasks of its key and group are ahead of it across workers
# (oldest first, as the holder grants), and when the key's next round is.
# Rule: facts from the workers (worker/visibility.py) and the holder's database;
# the reason is derived here, in one place.
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from ..core.config import gathering_moment
from ..errors import CallerError, ConfigurationError
from .deployment import Deployment, deployment_of

EXPLAIN = {
    "limit": "the key's limit is reached; it waits for a permit to come back",
    "group_limit": "its group's ceiling within the key is reached",
    "not_permitted": "the semaphore's can_grant callback refuses this worker the group",
    "limit_resolution_error": "the limit or group_limit callback raised or returned "
    "nonsense; nothing of what it governs is admitted",
    "holder_error": "the holder's last answer for the key was an error",
    "pool_full": "every pool slot of its worker is busy; a permit is taken only when one "
    "is free",
    "waiting_for_reply": "its worker asked the holder and awaits the answer",
    "queued": "older tasks of its key and group go first, or its worker has not asked "
    "the holder yet",
}
"""Every reason `why` gives: the holder's blocked reasons, then what the worker waits for."""
FOUND_ORDER = ("held", "running", "active", "reserved")
"""Which answer wins when several workers have the task (a redelivered message)."""


def reason_of(facts: dict[str, Any]) -> str:
    """Why a held task waits: the holder's blocked reason for its key and group, else
    the holder's error, a full pool, a report in flight, or its turn."""
    if facts.get("blocked") in EXPLAIN:
        return str(facts["blocked"])
    if facts.get("error"):
        return "holder_error"
    if isinstance(facts.get("free_slots"), int) and facts["free_slots"] <= 0:
        return "pool_full"
    if facts.get("waiting_for_reply") is not None:
        return "waiting_for_reply"
    return "queued"


def since_reply(reason: str, limit: int | None, in_use: int, group_limit: int | None,
                group_in_use: int) -> str:
    """What changed since the reply a blocked reason comes from: the holder's usage, read
    now, may already show room that its next round hands out."""
    if reason == "limit" and limit is not None and in_use < limit:
        free = limit - in_use
    elif reason == "group_limit" and group_limit is not None and group_in_use < group_limit:
        free = group_limit - group_in_use
    else:
        return ""
    return (f" (as of its worker's last reply: {free} permit(s) came back since, for the "
            "next round to hand out)")


def next_round_in(last_round_at: float | None, round_period: float, round_wait: float,
                  now: float) -> float | None:
    """Seconds until the round a blocked key's parked requests wait for at the latest:
    last round + round_period + the holder's gathering moment (holder/batching.py);
    0 when that is past (the next request starts one); None before any round."""
    if last_round_at is None:
        return None
    at = last_round_at + round_period + gathering_moment(round_wait)
    return round(max(0.0, at - now), 3)


@dataclass
class Found:
    node: str
    facts: dict[str, Any]


def _task_id(raw: str) -> str:
    if not raw.strip() or len(raw) > 255 or any(c.isspace() for c in raw):
        raise CallerError(f"not a task id: {raw!r}")
    return raw


def locate(deployment: Deployment, task_id: str) -> Found:
    answers = deployment.ask("durability_task", {"task_id": task_id})
    if not answers:
        raise ConfigurationError(
            f"no client worker answered within {deployment.timeout:g} s "
            f"({len(deployment.answered)} node(s) without a gate did): start the workers "
            "of this --app, or raise --timeout")
    found = [Found(node, answer) for node, answer in sorted(answers.items())
             if answer.get("state") in FOUND_ORDER]
    if not found:
        raise CallerError(
            f"task {task_id!r} is not held or running on any of the {len(answers)} "
            "worker(s) that answered: it has finished, is still in the broker, or is unknown")
    return min(found, key=lambda f: FOUND_ORDER.index(f.facts["state"]))


def ahead(deployment: Deployment, facts: dict[str, Any]) -> dict[str, int]:
    """Tasks of the key held across workers and enqueued before this one: of its group,
    of the whole key, and how many workers hold tasks of the key."""
    answers = deployment.ask(
        "durability_ahead", {"semaphore": facts["semaphore"], "key": facts["key"],
                             "before": facts["enqueued_at"]},
        expect=len(deployment.answered) or None)
    in_group = in_key = 0
    holding = set()
    for node, answer in answers.items():
        for row in answer.get("groups") or []:
            in_key += int(row["ahead"])
            in_group += int(row["ahead"]) if row["group"] == facts["group"] else 0
            if row["held"]:
                holding.add(node)
    return {"group": in_group, "key": in_key, "workers": len(holding)}


def held_report(deployment: Deployment, task_id: str, found: Found) -> dict[str, Any]:
    facts = found.facts
    semaphore, key, group = facts["semaphore"], facts["key"], facts["group"]
    usage = deployment.usage(semaphore, key)
    state = deployment.state(semaphore, key)
    config = deployment.semaphore(semaphore).config
    now = time.time()
    reason = reason_of(facts)
    groups = {g.group: g for g in usage.groups}
    mine = groups.get(group)
    group_in_use = mine.outstanding + mine.lease_footprint if mine else 0
    since = since_reply(reason, usage.limit, usage.in_use, mine.limit if mine else None,
                        group_in_use)
    return {
        "task_id": task_id, "state": "held", "worker": found.node,
        "semaphore": semaphore, "key": key, "group": group,
        "reason": reason, "explanation": EXPLAIN[reason] + since, "error": facts.get("error"),
        "held_for": facts.get("held_for"), "waited": round(now - facts["enqueued_at"], 3),
        "ahead": ahead(deployment, facts),
        "limit": usage.limit, "in_use": usage.in_use, "grants": usage.grants,
        "leases": usage.leases,
        "group_limit": mine.limit if mine else None,
        "group_in_use": group_in_use,
        "holder_blocked": [b.to_dict() for b in usage.blocked],
        "free_slots": facts.get("free_slots"), "waiting_for_reply": facts.get("waiting_for_reply"),
        "last_round_ago": None if state.last_round_at is None
        else round(now - state.last_round_at, 3),
        "next_round_in": next_round_in(state.last_round_at, config.round_period,
                                       config.round_wait, now),
    }


def report(deployment: Deployment, task_id: str) -> dict[str, Any]:
    found = locate(deployment, task_id)
    if found.facts["state"] == "held":
        return held_report(deployment, task_id, found)
    return {"task_id": task_id, "worker": found.node, **found.facts}


def _group(name: str | None) -> str:
    return "(no group)" if name is None else name


def render(found: dict[str, Any]) -> str:
    """The short human-readable block."""
    task, worker = found["task_id"], found["worker"]
    if found["state"] == "running":
        group = "no group" if found["group"] is None else f"group {found['group']}"
        return (f"task {task}: running on {worker} for {found['running_for']:.1f} s, on a "
                f"{found['source']} permit of {found['semaphore']} / {found['key']}, {group}")
    if found["state"] != "held":
        return (f"task {task}: {found['state']} on {worker} outside the gate "
                f"(not an admitted task: {found['task']})")
    limit = "?" if found["limit"] is None else found["limit"]
    ceiling = ("" if found["group_limit"] is None
               else f": {found['group_in_use']} in use of group limit {found['group_limit']}")
    error = f" ({found['error']})" if found["error"] else ""
    ahead_of = found["ahead"]
    nxt = found["next_round_in"]
    when = ("no round yet" if nxt is None else "due: the next request starts it" if nxt == 0
            else f"in {nxt:.1f} s at the latest (sooner when a permit comes back)")
    return "\n".join([
        f"task {task}: held by {worker} for {found['held_for']:.1f} s "
        f"({found['waited']:.1f} s since published)",
        f"  semaphore   {found['semaphore']}",
        f"  key         {found['key']}: {found['in_use']} in use of limit {limit} "
        f"({found['grants']} grant(s), {found['leases']} lease(s))",
        f"  group       {_group(found['group'])}{ceiling}",
        f"  reason      {found['reason']}: {found['explanation']}{error}",
        f"  ahead       {ahead_of['group']} of its key and group, {ahead_of['key']} of the key "
        f"(held by {ahead_of['workers']} worker(s), oldest first)",
        f"  next round  {when}",
    ])


def why_command(args: argparse.Namespace) -> int:
    task_id = _task_id(args.task_id)
    with deployment_of(args) as deployment:
        found = report(deployment, task_id)
    print(json.dumps(found, indent=2, sort_keys=True) if args.json else render(found))
    return 0
