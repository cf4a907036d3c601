# The user's limit callbacks behind the core's LimitSource: checked once, when a
# semaphore is made, naming the setting; the core validates what they answer.
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from .core.config import validate_limit_value
from .errors import ConfigurationError

LimitCallback = Callable[[str], int]
GroupLimitCallback = Callable[[str, str], "int | None"]
CanGrantCallback = Callable[[str, str, "str | None"], bool]

def check_callable(setting: str, value: object, params: Sequence[str]) -> None:
    """A callback must be callable with `params` positionally (checked where Python can)."""
    if not callable(value):
        raise ConfigurationError(f"{setting} must be callable, got {type(value).__name__}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        signature.bind(*params)
    except TypeError:
        raise ConfigurationError(
            f"{setting} must accept {len(params)} positional argument(s) "
            f"({', '.join(params)}); its signature is {signature}"
        ) from None


class CallbackLimits:
    """The core's LimitSource over the user's settings; the core validates the answers."""

    def __init__(self, limit: int | LimitCallback, group_limit: GroupLimitCallback | None,
                 can_grant: CanGrantCallback | None) -> None:
        if isinstance(limit, int) and not isinstance(limit, bool):
            validate_limit_value("limit", limit)
        elif callable(limit):
            check_callable("limit", limit, ("key",))
        else:
            raise ConfigurationError(
                f"limit must be an int or a callable(key) -> int, got {type(limit).__name__}"
            )
        if group_limit is not None:
            check_callable("group_limit", group_limit, ("key", "group"))
        if can_grant is not None:
            check_callable("can_grant", can_grant, ("key", "client_id", "group"))
        self._limit = limit
        self._group_limit = group_limit
        self._can_grant = can_grant

    def limit(self, key: str) -> int:
        return self._limit if isinstance(self._limit, int) else self._limit(key)

    def group_limit(self, key: str, group: str) -> int | None:
        return None if self._group_limit is None else self._group_limit(key, group)

    def can_grant(self, key: str, client_id: str, group: str | None) -> bool:
        return True if self._can_grant is None else self._can_grant(key, client_id, group)


class KeyLimits:
    """One key's LimitSource for one round, its `limit` asked when made (before the
    round's transaction begins); an exception it raised is raised again to the core,
    which turns it into the key's `limit_resolution_error`, as if asked in the round."""

    def __init__(self, limits: CallbackLimits, key: str) -> None:
        self._limits = limits
        self._limit: int | None = None
        self._error: Exception | None = None
        try:
            self._limit = limits.limit(key)
        except Exception as exc:
            self._error = exc

    def limit(self, key: str) -> int:
        if self._error is not None:
            raise self._error
        return self._limit  # type: ignore[return-value]

    def group_limit(self, key: str, group: str) -> int | None:
        return self._limits.group_limit(key, group)

    def can_grant(self, key: str, client_id: str, group: str | None) -> bool:
        return self._limits.can_grant(key, client_id, group)
