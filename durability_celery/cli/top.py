# `durability-celery top`: the busiest keys of a running deployment, drawn as the
# demo draws its accounts (cli/view.py): per key, tasks running and held by the
# client workers (their `durability_held` answers), the holder's usage against
# the limit, and why demand is blocked; refreshed every second, or once.
# Rule: read-only; the workers' numbers and the holder's are shown side by side,
# never mixed (each is a snapshot taken a moment apart).
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from ..errors import ConfigurationError
from .deployment import Deployment, KeyActivity, deployment_of, key_activity
from .view import AccountView, GroupView, Snapshot, live_view

REFRESH = 1.0
"""Seconds between two frames of the live view."""


def _key_view(deployment: Deployment, activity: KeyActivity) -> AccountView:
    usage = deployment.usage(activity.semaphore, activity.key)
    ceilings = {g.group: g.limit for g in usage.groups}
    holder_blocked = {b.group: b.reason for b in usage.blocked}
    groups = [
        GroupView(group, found.running, ceilings.get(group),
                  ",".join(sorted(found.blocked)) or holder_blocked.get(group), held=found.held)
        for group, found in sorted(activity.groups.items(),
                                   key=lambda g: (g[0] is not None, g[0] or ""))
    ]
    return AccountView(
        account=f"{activity.semaphore} / {activity.key}", limit=usage.limit,
        running=activity.running, queued=activity.held, in_use=usage.in_use,
        leases=usage.leases, lease_footprint=usage.lease_footprint, groups=groups)


def snapshot(deployment: Deployment, *, rows: int, started_at: float) -> Snapshot:
    """One frame: the `rows` busiest keys, from the workers' answers and the holder."""
    answers = deployment.ask("durability_held")
    busy = key_activity(answers)
    views = [_key_view(deployment, activity) for activity in busy[:rows]]
    shown = f"; the {len(views)} busiest shown" if len(busy) > len(views) else ""
    return Snapshot(
        title=f"durability-celery top: {len(answers)} worker(s), "
        f"{len(busy)} key(s) with tasks held or running{shown}",
        elapsed=time.monotonic() - started_at, done=None, total=None, accounts=views,
        group_label="group", queued_label="held",
        footer=time.strftime("%H:%M:%S") + (
            "" if views else "  nothing held or running"),
    )


def as_json(snap: Snapshot) -> dict[str, Any]:
    return {"title": snap.title, "keys": [asdict(view) for view in snap.accounts]}


def _rows(raw: int) -> int:
    if not 1 <= raw <= 1000:
        raise ConfigurationError(f"--limit must be between 1 and 1000, got {raw}")
    return raw


def top_command(args: argparse.Namespace) -> int:
    rows = _rows(args.limit)
    started_at = time.monotonic()
    with deployment_of(args) as deployment:
        if args.json:
            print(json.dumps(as_json(snapshot(deployment, rows=rows, started_at=started_at)),
                             indent=2))
            return 0
        from rich.console import Console

        if args.once:
            Console().print(live_view(snapshot(deployment, rows=rows, started_at=started_at)))
            return 0
        from rich.live import Live

        try:
            with Live(refresh_per_second=4) as live:
                while True:
                    began = time.monotonic()
                    frame = snapshot(deployment, rows=rows, started_at=started_at)
                    frame.footer = f"{frame.footer}  refreshed every {REFRESH:g} s; Ctrl-C quits"
                    live.update(live_view(frame))
                    # The workers' answers take up to the inspect timeout of each frame.
                    time.sleep(max(0.0, REFRESH - (time.monotonic() - began)))
        except KeyboardInterrupt:  # how a live view is left: not an error
            return 0
