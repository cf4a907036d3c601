# The Celery layer's settings: one validated, frozen object built once at
# start-up. A bad value fails here, naming the setting and its allowed range.
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigurationError

_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,60}$")


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigurationError(f"{name} must be between {low} and {high}, got {value}")


def _check_count(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {value!r}")
    _check_range(name, value, low, high)


@dataclass(frozen=True)
class DurabilitySettings:
    """How the holder, the client workers and beat talk to each other."""

    shards: int = 16
    """Holder queues; keys map onto them by a stable hash. Changing it moves keys."""
    queue_prefix: str = "durability"
    shard_queue_type: str = "classic"
    """"classic", or "quorum" for the holder's shard queues on RabbitMQ (docs/operations.md):
    every holder and client of a deployment must say the same, as RabbitMQ refuses a
    declaration of an existing queue with another type."""
    request_timeout: float = 5.0
    """A request unanswered this long counts as lost; the client asks again. Keep it well
    under a semaphore's grant_timeout: a claim counts only once a report of it reaches the
    holder before the claim deadline, and one lost message costs this long."""
    claim_margin: float | None = None
    """Never claim a grant permit this close to its claim deadline. None: half of each
    semaphore's grant_timeout, so that a claim's first report, if lost, is retried in time
    (a claim counts only once a report of it reaches the holder before the deadline)."""
    max_held: int | None = None
    """Task messages one worker holds waiting for permits; None: 8 x pool size. While
    every pool slot is taken, a worker holds at most one per slot (and half of it)
    (worker/gate/hold.py Hold._may_raise, worker/step.py HELD_PER_SLOT)."""
    hold_deadline: float | None = None
    """Hand a held message back to the broker after this long; None: derived from the broker."""
    reply_expires: float = 300.0
    """A reply queue unused this long is deleted by the broker."""
    round_threads: int = 4
    """Holder threads running rounds, so a slow key does not stall the others."""
    reclaim_interval: float = 10.0
    """How often beat reclaims expired unclaimed grants (a safety net under the holder's timer)."""
    supports_leases: bool = True
    reconcile_after: float | None = None
    """Forget a client's grants and leases once no holder heard from it for this long AND
    no live worker claims its id (None, the default: never; the spec's behaviour)."""
    reconcile_interval: float = 60.0
    """How often beat looks for silent clients when `reconcile_after` is set."""
    prune_after: float | None = None
    """Delete the rows of keys that hold nothing and had no round for this long (None, the
    default: never; DurabilitySemaphore.prune). At least each semaphore's round_period."""
    prune_interval: float = 3600.0
    """How often beat prunes when `prune_after` is set."""
    metrics_key_labels: bool = False
    """Give the metric series counted per key a `key` label (docs/operations.md, "Metrics").
    Off by default: every key becomes a series of its own, and keys may be countless."""

    @property
    def shard_queue_arguments(self) -> dict[str, str] | None:
        """The shard queues' declaration arguments (queues.holder_queue_declaration)."""
        return {"x-queue-type": "quorum"} if self.shard_queue_type == "quorum" else None

    def __post_init__(self) -> None:
        _check_count("shards", self.shards, 1, 4096)
        if not isinstance(self.queue_prefix, str) or not _PREFIX.match(self.queue_prefix):
            raise ConfigurationError("queue_prefix must match [A-Za-z0-9_.-]{1,60}")
        if self.shard_queue_type not in ("classic", "quorum"):
            raise ConfigurationError(
                f"shard_queue_type must be 'classic' or 'quorum', got {self.shard_queue_type!r}")
        _check_range("request_timeout", self.request_timeout, 0.05, 3600)
        if self.claim_margin is not None:
            _check_range("claim_margin", self.claim_margin, 0, 3600)
        if self.max_held is not None:
            _check_count("max_held", self.max_held, 1, 1_000_000)
        if self.hold_deadline is not None:
            _check_range("hold_deadline", self.hold_deadline, 1, 7 * 86400)
        _check_range("reply_expires", self.reply_expires, 1, 86400)
        _check_count("round_threads", self.round_threads, 1, 256)
        _check_range("reclaim_interval", self.reclaim_interval, 0.1, 86400)
        if self.reconcile_after is not None:
            _check_range("reconcile_after", self.reconcile_after, 10, 30 * 86400)
        _check_range("reconcile_interval", self.reconcile_interval, 0.1, 86400)
        if self.prune_after is not None:
            _check_range("prune_after", self.prune_after, 1, 366 * 86400)
        _check_range("prune_interval", self.prune_interval, 1, 7 * 86400)
        if not isinstance(self.supports_leases, bool):
            raise ConfigurationError("supports_leases must be a bool")
        if not isinstance(self.metrics_key_labels, bool):
            raise ConfigurationError("metrics_key_labels must be a bool")

    def claim_margin_for(self, grant_timeout: float) -> float:
        """The claim margin used for a semaphore with this grant_timeout."""
        return self.claim_margin if self.claim_margin is not None else grant_timeout / 2
