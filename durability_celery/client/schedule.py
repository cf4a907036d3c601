# When one key talks to its holder, and what it has in flight: the one owner of
# the messages a key awaits (KeySchedule for their timing, Replies for which
# replies are still accepted; the gate asks the client, and keeps no copy). A
# message sent while another is in flight supersedes it, and the oldest
# unanswered one is kept: its send time anchors the deadlines of whatever reply
# comes, early rather than late. A failure backs off, doubling per failure in a
# row up to a cap.
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
    seen_round: int | None = None
    """The highest round number of the replies applied (sent as Request.seen_round)."""
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


@dataclass(slots=True)
class _Awaited:
    newest: str
    older: tuple[str, ...] = ()
    """Correlation ids of the older messages `newest` superseded, still answered."""


class Replies:
    """The replies one client still accepts, by correlation id: per key, its newest
    message's, and those of the older messages the newest superseded (see
    KeySchedule.sent). A message that timed out no longer counts as in flight, but its
    reply is still welcome until a newer message of the key replaces it (a reply lists
    every grant and lease, so any newer one makes the older ones' redundant); the
    record outlives the key's ledger, and a late reply brings it back."""

    def __init__(self) -> None:
        self._by_key: dict[str, _Awaited] = {}
        self._keys: dict[str, str] = {}
        """correlation id -> key, for every id awaited."""

    def sent(self, key: str, correlation_id: str, *, superseding: bool) -> None:
        """A message of `key` went out; `superseding`: older ones stay awaited."""
        previous = self._by_key.get(key)
        older: tuple[str, ...] = ()
        if previous is not None:
            if superseding:
                older = (*previous.older, previous.newest)
            else:
                self._forget(previous)
        self._by_key[key] = _Awaited(correlation_id, older)
        self._keys[correlation_id] = key

    def answered(self, correlation_id: str | None) -> tuple[str, bool] | None:
        """The key a reply answers and whether it answers a superseded message (the newer
        one stays awaited); None: no message we still await (a late or repeated one).
        A reply to the newest message answers the older ones too."""
        key = self._keys.get(correlation_id) if correlation_id is not None else None
        if key is None or correlation_id is None:
            return None
        entry = self._by_key[key]
        if correlation_id == entry.newest:
            del self._by_key[key]
            self._forget(entry)
            return key, False
        entry.older = tuple(c for c in entry.older if c != correlation_id)
        del self._keys[correlation_id]
        return key, True

    def unsent(self, key: str, correlation_id: str) -> bool:
        """Publishing the message failed: True if it was the key's newest, now forgotten
        with the older ones, as KeySchedule.fail forgets them."""
        entry = self._by_key.get(key)
        if entry is None or entry.newest != correlation_id:
            return False
        del self._by_key[key]
        self._forget(entry)
        return True

    def awaited(self, key: str) -> tuple[str, ...]:
        """The correlation ids of `key` whose replies are still accepted, oldest first."""
        entry = self._by_key.get(key)
        return () if entry is None else (*entry.older, entry.newest)

    def _forget(self, entry: _Awaited) -> None:
        for correlation_id in (*entry.older, entry.newest):
            self._keys.pop(correlation_id, None)
