# The client queue: items waiting for a permit, per key and group, oldest first
# (by enqueue time, then arrival). An item is queued at most once.
from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

Order = tuple[float, int, str]
"""How queued items sort: (enqueued_at, arrival sequence, item_id)."""


@dataclass(frozen=True, slots=True)
class Queued:
    item_id: str
    key: str
    group: str | None
    enqueued_at: float
    seq: int

    @property
    def order(self) -> Order:
        return (self.enqueued_at, self.seq, self.item_id)


class ClientQueue:
    """Queued items by id, and per key and group in order."""

    def __init__(self) -> None:
        self.items: dict[str, Queued] = {}
        self.by_key: dict[str, dict[str | None, list[Order]]] = {}
        """key -> group -> queued items, oldest first; a key or group with none is absent."""
        self._seq = 0
        """The next item's place among items enqueued at the same time. An int, not an
        itertools.count: Python 3.14's copy.deepcopy, which the property tests use on a
        client, no longer copies itertools objects."""

    def add(self, key: str, group: str | None, item_id: str, enqueued_at: float) -> None:
        item = Queued(item_id, key, group, enqueued_at, self._seq)
        self._seq += 1
        self.items[item_id] = item
        bisect.insort(self.by_key.setdefault(key, {}).setdefault(group, []), item.order)

    def remove(self, item_id: str) -> Queued | None:
        item = self.items.pop(item_id, None)
        if item is None:
            return None
        groups = self.by_key[item.key]
        queue = groups[item.group]
        del queue[bisect.bisect_left(queue, item.order)]
        if not queue:
            del groups[item.group]
            if not groups:
                del self.by_key[item.key]
        return item

    def each(self) -> Iterator[tuple[str, str | None, list[Order]]]:
        for key, groups in self.by_key.items():
            for group, queue in groups.items():
                yield key, group, queue

    def youngest(self, key: str, count: int) -> list[str]:
        """The ids of `key`'s `count` youngest queued items, across its groups."""
        orders = (order for queue in self.by_key.get(key, {}).values() for order in queue)
        return [item_id for _, _, item_id in sorted(orders, reverse=True)[:max(0, count)]]

    def counts(self) -> dict[str, dict[str | None, int]]:
        """Queued items per key and group."""
        counts: dict[str, dict[str | None, int]] = {}
        for key, group, queue in self.each():
            counts.setdefault(key, {})[group] = len(queue)
        return counts
