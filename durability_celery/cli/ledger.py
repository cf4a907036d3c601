# The demo's independent ledger: each demo task appends a `start` and an `end`
# event (JSON lines, one O_APPEND write each, so concurrent writers never
# interleave) to a file the holder never touches. The verdict is computed from
# this file alone, so it checks the semaphore rather than trusting it.
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def record(path: Path | str, event: str, task_id: str, account: str, group: str | None) -> None:
    """Append one event; a single write() of a short line is atomic with O_APPEND."""
    line = json.dumps({"e": event, "id": task_id, "key": account, "group": group,
                       "t": time.time(), "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: Path | str) -> list[dict[str, Any]]:
    """Every complete event in the ledger (a torn last line is ignored)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


@dataclass
class Tally:
    """What the ledger says: per key and per (key, group)."""

    started: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    finished: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    running: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    running_group: dict[tuple[str, str | None], int] = field(
        default_factory=lambda: defaultdict(int))
    peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_group: dict[tuple[str, str | None], int] = field(
        default_factory=lambda: defaultdict(int))
    finished_ids: set[str] = field(default_factory=set)
    duplicates: set[str] = field(default_factory=set)


def tally(events: Iterable[Mapping[str, Any]]) -> Tally:
    """Replay events in time order (an end before a start at the same instant)."""
    result = Tally()
    started: set[str] = set()
    ordered = sorted(events, key=lambda e: (e["t"], 0 if e["e"] == "end" else 1))
    for event in ordered:
        key, group, task_id = event["key"], event.get("group"), event["id"]
        if event["e"] == "start":
            if task_id in started:
                result.duplicates.add(task_id)
            started.add(task_id)
            result.started[key] += 1
            result.running[key] += 1
            result.running_group[(key, group)] += 1
            result.peak[key] = max(result.peak[key], result.running[key])
            result.peak_group[(key, group)] = max(
                result.peak_group[(key, group)], result.running_group[(key, group)])
        elif event["e"] == "end":
            result.finished[key] += 1
            result.finished_ids.add(task_id)
            result.running[key] -= 1
            result.running_group[(key, group)] -= 1
    return result
