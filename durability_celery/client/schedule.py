# When one key talks to its holder, and what it has in flight: the one owner of
# the messages a key awaits. A message sent while another is in flight
# supersedes it, and the oldest unanswered one is kept: its send time anchors
# the deadlines of whatever reply comes, early rather than late. A failure
# backs off, doubling per failure in a row up to a cap.
from __future__ import annotations

import math
from dataclasses import dataclass

BACKOFF_BASE = 0.5
"""Seconds to wait after the first failure of a key; doubles per failure in a row."""
BACKOFF_MAX = 30.0
"""Longest wait between attempts, so a holder that is back is found again soon."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """A message of a key that awaits its reply."""

    sent_at: float
    stopped_leases: frozenset[str]
    asked: int = 0
    """Items its demand asked for, over all groups."""
    reported: int = 0
    """What its reports added up to (see KeyLedger.report_total)."""
    released: int = 0
    """Its release marks, summed (see KeyLedger.released_total)."""


@dataclass(slots=True)
class KeySchedule:
    """One key's messages in flight, its backoff, and when its holder wants to hear."""

    next_request_at: float = 0.0
    last_round_at: float = -math.inf
    in_flight: InFlight | None = None
    superseded: InFlight | None = None
    """The oldest message still in flight when `in_flight` was sent (see SemaphoreClient)."""
    superseded_count: int = 0
    """How many messages older than `in_flight` are still awaited (superseded is the oldest)."""
    last_sent_at: float | None = None
    failures: int = 0
    backoff_until: float = 0.0
    last_error: str | None = None

    @property
    def awaiting(self) -> bool:
        """Some message of the key still awaits its reply."""
        return self.in_flight is not None or self.superseded is not None

    def sent(self, message: InFlight) -> None:
        """A message goes out; one sent while another is in flight supersedes it."""
        if self.in_flight is not None:
            if self.superseded is None:
                self.superseded = self.in_flight
            self.superseded_count += 1
        self.in_flight = message
        self.last_sent_at = message.sent_at

    def fail(self, now: float, reason: str, *, cap: float = BACKOFF_MAX,
             superseded: bool = False) -> None:
        """The in-flight message failed: wait before the next attempt.

        The wait doubles per failure in a row, up to `cap`: a client that loses
        messages often must still ask again soon, or its queue stalls.
        `superseded`: only the older message a newer one superseded failed; the
        newer one carries everything it did, so nothing else changes."""
        if superseded:
            self._older_answered()
            return
        self.in_flight = self.superseded = None
        self.superseded_count = 0
        self.failures += 1
        wait = BACKOFF_BASE * 2 ** min(self.failures - 1, 16)
        self.backoff_until = now + min(cap, BACKOFF_MAX, wait)
        self.last_error = reason

    def answered(self, *, superseded: bool) -> tuple[InFlight | None, float | None]:
        """A reply came: the message it answers (None: none we still track) and the send
        time that anchors its deadlines. `superseded`: it answers the older message a
        newer one superseded, and the newer one stays in flight; a reply to the newer one
        answers both (it lists every grant and lease, from a round no older)."""
        if superseded:
            # The oldest awaited message's send time anchors any older one's reply safely.
            message = self.superseded
            sent_at = message.sent_at if message else self.last_sent_at
            self._older_answered()
        else:
            message = self.in_flight
            oldest = self.superseded or message
            sent_at = oldest.sent_at if oldest else self.last_sent_at
            self.in_flight = self.superseded = None
            self.superseded_count = 0
        self.failures = 0
        self.backoff_until = 0.0
        self.last_error = None
        return message, sent_at

    def _older_answered(self) -> None:
        """One of the messages older than `in_flight` was answered (or failed)."""
        self.superseded_count = max(0, self.superseded_count - 1)
        if not self.superseded_count:
            self.superseded = None

    def timed_out(self, now: float, timeout: float) -> bool:
        return self.in_flight is not None and now >= self.in_flight.sent_at + timeout
