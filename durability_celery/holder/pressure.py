# The holder's back-pressure: whether it has fallen behind, and how much later it
# tells clients to ask. Rule: one place holds the overload state (read by logs and
# metrics); the dispatcher thread alone calls `observe`, anything may read.
#
# The measure is the lag of due work: how long the earliest due round or reclaim
# has waited for a round thread, or a round batch ran, or requests wait in the
# shard queues. A holder that cannot keep up sees it grow, and each client's
# next request then waited that long more. The remedy is fewer
# rounds per busy key: the holder stretches the key's period (its replies'
# next_request_at, and when its batcher serves the requests told to come) by
# `stretch`, so each key's cycle keeps its length but spends it with the client
# instead of as lag, and request -> reply stays short (docs/operations.md). The
# batcher serves a key's parked requests by the period its last replies told
# (Batcher.finished), so a change of the stretch never holds a request that
# was told to come at once.
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("durability_celery.holder")

TARGET_LAG_SHARE = 0.25
"""Lag the holder aims at, as a share of the shortest round_period it serves (at least
MIN_TARGET_LAG); more stretches the period, less (half of it) lets it shrink back."""
MIN_TARGET_LAG = 0.2
"""A round batch takes tens of milliseconds anyway: with very short periods, a holder
is not behind for that."""
OVERLOAD_LAG = 1.0
"""Seconds of lag that make the holder overloaded even before it stretches anything."""
MAX_STRETCH = 8.0
"""The most a period is stretched, unless that is shorter than MAX_STRETCHED_PERIOD:
past it, requests wait (and more holders are due)."""
MAX_STRETCHED_PERIOD = 10.0
"""Seconds a stretched period may reach whatever its round_period: a semaphore of very
short rounds (0.05 s) is relieved only by far more than MAX_STRETCH."""
SHRINK = 0.85
"""Factor the stretch shrinks by per period without lag: gradual, as load comes back."""
MIN_ADJUST = 0.25
"""Seconds between two looks that may grow the stretch; it shrinks at most once per
(shortest) period: a change shows in the lag once the clients it told asked again."""
LOG_EVERY = 30.0


@dataclass(frozen=True)
class PressureView:
    """What the holder reports about its load (for logs and metrics)."""

    overloaded: bool
    stretch: float
    lag: float
    """Seconds requests waited lately, at most (for a round thread, in a round batch,
    in the shard queues)."""
    waiting: int
    """Requests held for rounds."""
    shed: int
    """Requests answered with a newer request's reply instead of a round of their own."""


class Pressure:
    """The overload state of one holder and the stretch it applies to periods."""

    def __init__(self, shortest_period: Callable[[], float]) -> None:
        self._shortest_period = shortest_period
        self.stretch = 1.0
        """Factor on every round_period while the holder is behind (1.0: not behind)."""
        self.overloaded = False
        self.lag = 0.0
        self.waiting = 0
        self.shed = 0
        self._peak = 0.0
        self._last_peak = 0.0
        self._next_adjust: float | None = None
        self._next_log = 0.0
        self._warned = False

    def view(self) -> PressureView:
        return PressureView(self.overloaded, self.stretch, self.lag, self.waiting, self.shed)

    def period(self, round_period: float) -> float:
        """`round_period` as the holder serves it now."""
        return round_period * min(self.stretch, _most(round_period))

    @property
    def behind(self) -> bool:
        """Due work waited past the target lag lately, or periods are stretched: no
        reply tells its client to ask again before a (stretched) period."""
        return self.stretch > 1.0 or max(self._peak, self._last_peak) > _target(
            self._shortest_period())

    def waited(self, seconds: float) -> None:
        """Requests waited `seconds` where the lag of due work cannot see them: in a
        round batch that ran that long (taken, they are no longer due), or in the
        shard queues before the consumer took them (HolderConsumer)."""
        self._peak = max(self._peak, seconds)

    def observe(self, now: float, lag: float, waiting: int) -> None:
        """The dispatcher's look at its due jobs (`lag`: how late the earliest is): the
        stretch grows at each look (MIN_ADJUST apart) while the lag does, and shrinks
        at most once a period."""
        self.waiting = waiting
        self._peak = max(self._peak, lag)
        shortest = self._shortest_period()
        if self._next_adjust is None:
            self._next_adjust = now + MIN_ADJUST
        elif now >= self._next_adjust:
            self._next_adjust = now + self._adjust(shortest)
        self.lag = max(self._peak, self._last_peak)
        overloaded = self.stretch > 1.0 or self.lag > OVERLOAD_LAG
        self._log(now, overloaded)
        self.overloaded = overloaded

    def _adjust(self, shortest: float) -> float:
        """Change the stretch by the lag seen since the last change; returns how long
        until the next one."""
        target = _target(shortest)
        peak, self._peak = self._peak, 0.0
        growing = peak >= self._last_peak
        self._last_peak = peak
        if peak > target and growing:
            # The excess lag moves into the period: clients then spend it away from
            # the holder. Too much is the safe side (they ask a little less often),
            # so it grows at each look while the lag does: a request already parked
            # waits for the period its reply told plus the lag.
            self.stretch = min(_most(shortest), self.stretch + (peak - target) / shortest)
            return MIN_ADJUST
        if peak < target / 2 and self.stretch > 1.0:
            self.stretch = max(1.0, self.stretch * SHRINK)
            if self.stretch < 1.05:
                self.stretch = 1.0
        return max(MIN_ADJUST, shortest)

    def _log(self, now: float, overloaded: bool) -> None:
        # At most one warning per LOG_EVERY, however often the overload comes and goes.
        if overloaded and now >= self._next_log:
            self._next_log = now + LOG_EVERY
            self._warned = True
            logger.warning(
                "durability holder: overloaded: requests wait up to %.1f s, %d waiting for "
                "rounds, periods stretched x%.2f, %d superseded requests shed; more holders "
                "(--durability-shards) would help", self.lag, self.waiting, self.stretch,
                self.shed)
        elif self._warned and not overloaded:
            self._warned = False
            logger.info("durability holder: no longer overloaded")

    def stretch_reply(self, response: dict[str, Any], round_period: float) -> None:
        """While behind, tell the client of `response` to ask no sooner than a (stretched)
        period after its round. A blocked client too: told to ask at once, its request
        would wait at the holder for the period plus the lag, which then grows: the
        prompt round it waits for is lost in the lag anyway."""
        if not self.behind or "error" in response:
            return
        round_at, told = response.get("round_at"), response.get("next_request_at")
        if isinstance(round_at, int | float) and isinstance(told, int | float):
            response["next_request_at"] = max(told, round_at + self.period(round_period))


def _target(shortest_period: float) -> float:
    return max(MIN_TARGET_LAG, TARGET_LAG_SHARE * shortest_period)


def _most(round_period: float) -> float:
    """The largest stretch of `round_period`."""
    return max(MAX_STRETCH, MAX_STRETCHED_PERIOD / round_period)
