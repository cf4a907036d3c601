# Validated, frozen settings of one semaphore: provisioning modes, leases and
# round timing. Bad values fail here, at construction, naming the setting.
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..errors import CallerError, ConfigurationError
from ..wire.fields import MAX_COUNT, MAX_ID_LENGTH


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_COUNT:
        raise ConfigurationError(f"{name} must be between {minimum} and {MAX_COUNT}, got {value}")
    return value


def validate_seconds(name: str, value: object, *, minimum: float = 0.0) -> float:
    """A duration: finite, at least `minimum`, at most a year (else ConfigurationError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < minimum or seconds > 366 * 86400:
        raise ConfigurationError(
            f"{name} must be between {minimum} and 31622400 seconds, got {value}"
        )
    return seconds


def check_caller_seconds(name: str, value: object, *, positive: bool = False) -> float:
    """A duration a caller passed: finite and at least 0 (above 0 if `positive`), else
    CallerError (validate_seconds is its twin for settings, read at start-up)."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise CallerError(f"{name} must be a number of seconds {'> 0' if positive else '>= 0'}, "
                          f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Strict:
    """Leases share the limit with grants: grants first, leases from what is left."""

    mode: Literal["strict"] = "strict"


@dataclass(frozen=True)
class Under:
    """Keep `reserve` permits of the limit for leases; grants get `limit - reserve` (at least 1)."""

    reserve: int = 0
    mode: Literal["under"] = "under"

    def __post_init__(self) -> None:
        _positive_int("Under.reserve", self.reserve, minimum=0)


@dataclass(frozen=True)
class Over:
    """Leases draw from `extra` permits above the limit (a count, or a ratio of the limit)."""

    extra: int | None = None
    ratio: float | None = None
    mode: Literal["over"] = "over"

    def __post_init__(self) -> None:
        if (self.extra is None) == (self.ratio is None):
            raise ConfigurationError(
                "Over needs exactly one of extra= (a count) or ratio= (of the limit)"
            )
        if self.extra is not None:
            _positive_int("Over.extra", self.extra, minimum=0)
        if self.ratio is not None:
            ratio = self.ratio
            if (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                    or not 0 <= ratio <= 100):
                raise ConfigurationError(
                    f"Over.ratio must be a number between 0 and 100, got {ratio!r}")

    def extra_for(self, limit: int) -> int:
        """Permits above `limit` that leases may use."""
        if self.extra is not None:
            return self.extra
        assert self.ratio is not None
        return math.floor(limit * self.ratio)


Provisioning = Strict | Under | Over
LimitedGroups = Literal["exclude", "within_group_limit"]


@dataclass(frozen=True)
class Leases:
    """Blocks of permits that clients draw locally, one per task, with no round trip."""

    provisioning: Provisioning = Strict()
    permits_per_lease: int = 64
    ttl: float = 1800.0
    limited_groups: LimitedGroups = "exclude"
    idle: float | None = 0.5
    """Seconds after which a client returns a lease nothing has drawn from or released to,
    with nothing queued or running in its group; None keeps it until a contended round
    or `ttl`, as the spec does (its undrawn permits stay counted meanwhile)."""

    def __post_init__(self) -> None:
        if self.idle is not None:
            validate_seconds("Leases.idle", self.idle)
        if not isinstance(self.provisioning, Strict | Under | Over):
            raise ConfigurationError(
                "Leases.provisioning must be Strict(), Under(...) or Over(...)"
            )
        _positive_int("Leases.permits_per_lease", self.permits_per_lease)
        validate_seconds("Leases.ttl", self.ttl, minimum=1.0)
        if self.limited_groups not in ("exclude", "within_group_limit"):
            raise ConfigurationError(
                "Leases.limited_groups must be 'exclude' or 'within_group_limit', "
                f"got {self.limited_groups!r}"
            )


MIN_ROUND_PERIOD = 0.01
"""The shortest round_period accepted (seconds)."""


@dataclass(frozen=True)
class RoundConfig:
    """What a round needs to know besides state and messages."""

    semaphore: str
    grant_timeout: float = 10.0
    round_wait: float = 1.0
    round_period: float = 2.0
    leases: Leases | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.semaphore, str) or not 0 < len(self.semaphore) <= MAX_ID_LENGTH:
            raise ConfigurationError(
                f"semaphore name must be a non-empty string of at most {MAX_ID_LENGTH} chars"
            )
        validate_seconds("grant_timeout", self.grant_timeout, minimum=0.001)
        validate_seconds("round_wait", self.round_wait)
        # A period of zero would tell every client to ask again the moment it is answered.
        validate_seconds("round_period", self.round_period, minimum=MIN_ROUND_PERIOD)
        if self.leases is not None and not isinstance(self.leases, Leases):
            raise ConfigurationError("leases must be None or a Leases(...) instance")


GATHER = 0.1
"""Seconds a round waits past last round + round_period (at most round_wait).

Parked requests wait for the period's end, and clients told `round_at + round_period`
ask at that instant: a round started at the instant itself would miss the requests
sent on time by a few milliseconds, and they would wait a whole period more."""


def gathering_moment(round_wait: float) -> float:
    """GATHER, at most round_wait: how long past a period's end its round waits for the
    requests told to come then (and how early clients aim: SemaphoreClient.ask_early)."""
    return min(GATHER, round_wait)


def validate_limit_value(name: str, value: object) -> int:
    """A resolved limit: a non-negative int within bounds (raises ConfigurationError)."""
    return _positive_int(name, value, minimum=0)
