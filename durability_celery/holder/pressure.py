# The holder's back-pressure: whether it has fallen behind, and how much later it
# tells clients to ask. Rule: one place holds the overload state (read by logs and
# metrics); the dispatcher thread alone calls `observe`, anything may read.
#
# The measure is the lag of due work: how long the earliest due round or reclaim
# has waited for a round thread, or requests wait in the shard queues. How long
# a batch runs is not counted: that is service time, and stretching periods while
# round threads are free would only leave the holder idle. A holder that cannot
# keep up sees the lag grow, and each client's next request then waited that
# long more. The remedy is fewer
# rounds per busy key: the holder stretches every period it tells (its replies'
# next_request_at, and when its batcher serves the requests told to come) by
# `extra` seconds (less a random share per round, so keys that asked together
# drift apart), so each key's cycle keeps its length but spends it with the
# client instead of as lag, and request -> reply stays short
# (docs/operations.md). Seconds, not a factor: one holder serves semaphores of
# very different periods, and a lag that is many periods of a short one is a
# fraction of a long one's. The
# batcher serves a key's parked requests by the period its last replies told
# (Batcher.finished), so a change of the stretch never holds a request that
# was told to come at once.
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire.reply import ask_no_sooner, round_at_of

logger = logging.getLogger("durability_celery.holder")

TARGET_LAG_SHARE = 0.25
"""Lag the holder aims at, as a share of the shortest round_period it serves (at least
MIN_TARGET_LAG); more stretches the periods, less (half of it) lets them shrink back."""
MIN_TARGET_LAG = 0.2
"""A round batch takes tens of milliseconds anyway: with very short periods, a holder
is not behind for that."""
OVERLOAD_LAG = 1.0
"""Seconds of lag that make the holder overloaded even before it stretches anything."""
MAX_STRETCH = 8.0
"""A stretched period is at most this many times its round_period, or
MAX_STRETCHED_PERIOD if that is longer: past it, requests wait (more holders are due)."""
MAX_STRETCHED_PERIOD = 10.0
"""Seconds a stretched period may reach whatever its round_period: a semaphore of very
short rounds (0.05 s) is relieved only by far more than MAX_STRETCH times."""
SHRINK = 0.85
"""Factor the extra shrinks by per period with little lag: gradual, as load comes back."""
FAST_SHRINK = 0.5
"""Factor per period while requests wait less than IDLE_SHARE of the target lag: a holder
with room to spare, after a burst it is past."""
IDLE_SHARE = 0.25
MIN_ADJUST = 0.25
"""Seconds between two looks that may grow the extra; it shrinks at most once per
(shortest) period: a change shows in the lag once the clients it told asked again."""
MAX_EXTRA = 60.0
"""Seconds the extra may reach, so it shrinks back in bounded time (a period longer than
8 x 7.5 s is stretched less than MAX_STRETCH times)."""
SPREAD = 0.5
"""Share of the extra that each round's replies may be told less of, at random: keys
stretched by the same seconds keep asking together, and the tail of such a wave alone
can keep the lag past its target while the holder idles most of the period."""
LOG_EVERY = 30.0


@dataclass(frozen=True)
class PressureView:
    """What the holder reports about its load (for logs and metrics)."""

    overloaded: bool
    extra: float
    """Seconds added to every period the holder tells (0: none)."""
    lag: float
    """Seconds requests waited lately, at most (for a round thread, in the shard
    queues)."""
    waiting: int
    """Requests held for rounds."""
    shed: int
    """Requests answered with a newer request's reply instead of a round of their own."""


class Pressure:
    """The overload state of one holder and how much it stretches the periods it tells."""

    def __init__(self, shortest_period: Callable[[], float]) -> None:
        self._shortest_period = shortest_period
        self.extra = 0.0
        """Seconds added to every round_period while the holder is behind."""
        self.overloaded = False
        self.lag = 0.0
        self.waiting = 0
        self.shed = 0
        self._peak = 0.0
        self._last_peak = 0.0
        self._next_adjust: float | None = None
        self._settled_at = 0.0
        """When the clients told the last stretch have all asked again: before that, a
        lag gone quiet says nothing of the load they bring."""
        self._next_log = 0.0
        self._warned = False

    def view(self) -> PressureView:
        return PressureView(self.overloaded, self.extra, self.lag, self.waiting, self.shed)

    def period(self, round_period: float, share: float = 1.0) -> float:
        """`round_period` as the holder tells it now, with `share` of the extra (`spread`)."""
        most = max(MAX_STRETCH * round_period, MAX_STRETCHED_PERIOD)
        return max(round_period, min(round_period + self.extra * share, most))

    @staticmethod
    def spread() -> float:
        """The share of the extra one round's replies are told: all of it, less up to
        SPREAD at random, so that keys that asked together drift apart."""
        return 1.0 - SPREAD * random.random()

    @property
    def behind(self) -> bool:
        """Requests waited past the target lag lately, or periods are stretched: no
        reply tells its client to ask again before a (stretched) period."""
        return self.extra > 0.0 or max(self._peak, self._last_peak) > _target(
            self._shortest_period())

    def waited(self, seconds: float) -> None:
        """Requests waited `seconds` where the lag of due work cannot see them: in the
        shard queues before the consumer took them (HolderConsumer)."""
        self._peak = max(self._peak, seconds)

    def observe(self, now: float, lag: float, waiting: int) -> None:
        """The dispatcher's look at its due jobs (`lag`: how late the earliest is): the
        extra grows at each look (MIN_ADJUST apart) while the lag does, and shrinks
        at most once a period."""
        self.waiting = waiting
        self._peak = max(self._peak, lag)
        shortest = self._shortest_period()
        if self._next_adjust is None:
            self._next_adjust = now + MIN_ADJUST
        elif now >= self._next_adjust:
            self._next_adjust = now + self._adjust(shortest, now)
        self.lag = max(self._peak, self._last_peak)
        overloaded = self.extra > 0.0 or self.lag > OVERLOAD_LAG
        self._log(now, overloaded)
        self.overloaded = overloaded

    def _adjust(self, shortest: float, now: float) -> float:
        """Change the extra by the lag seen since the last change; returns how long
        until the next one."""
        target = _target(shortest)
        peak, self._peak = self._peak, 0.0
        self._last_peak = peak
        if peak > target:
            # The excess lag moves into the periods: clients then spend it away from
            # the holder. It is set, not added: looks that follow still see the lag of
            # requests told before the stretch, and adding each one's would stretch
            # far past what the holder can serve, leaving it idle for many periods.
            self.extra = max(self.extra, min(MAX_EXTRA, peak - target))
            self._settled_at = now + shortest + self.extra
            return MIN_ADJUST
        if peak < target / 2 and self.extra > 0.0:
            if now < self._settled_at:
                return max(MIN_ADJUST, min(shortest, self._settled_at - now))
            # Near the target, gradually: each step brings clients back sooner. Far
            # under it the holder idles, and a burst it is past (every worker asking at
            # once after a restart) must not pace its keys for many periods more.
            self.extra *= FAST_SHRINK if peak < IDLE_SHARE * target else SHRINK
            if self.extra < max(0.05 * shortest, MIN_TARGET_LAG / 2):
                self.extra = 0.0  # less than a lag it would not stretch for
        return max(MIN_ADJUST, shortest)

    def _log(self, now: float, overloaded: bool) -> None:
        # At most one warning per LOG_EVERY, however often the overload comes and goes.
        if overloaded and now >= self._next_log:
            self._next_log = now + LOG_EVERY
            self._warned = True
            logger.warning(
                "durability holder: overloaded: requests wait up to %.1f s, %d waiting for "
                "rounds, periods told %.1f s longer, %d superseded requests shed; more "
                "holders (--durability-shards) would help", self.lag, self.waiting,
                self.extra, self.shed)
        elif self._warned and not overloaded:
            self._warned = False
            logger.info("durability holder: no longer overloaded")

    def stretch_reply(self, response: dict[str, Any], round_period: float,
                      share: float = 1.0) -> None:
        """While behind, tell the client of `response` to ask no sooner than a (stretched,
        by `share` of the extra) period after its round. A blocked client too: told to ask
        at once, its request would wait at the holder for the period plus the lag, which
        then grows: the prompt round it waits for is lost in the lag anyway."""
        round_at = round_at_of(response)
        if self.behind and round_at is not None:
            ask_no_sooner(response, round_at + self.period(round_period, share))


def _target(shortest_period: float) -> float:
    return max(MIN_TARGET_LAG, TARGET_LAG_SHARE * shortest_period)
