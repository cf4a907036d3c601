# Resolves a semaphore's live limits once per round and remembers the answers,
# so one round sees one consistent limit. User callbacks may raise or return
# nonsense: that fails closed (no admissions for what they govern) and never
# escapes the round.
from __future__ import annotations

from ..wire.fields import MAX_COUNT
from .keystate import LimitSource


def _valid_count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_COUNT


class ResolvedLimits:
    """One round's view of `limit`, `group_limit` and `can_grant` for one key."""

    def __init__(self, source: LimitSource, key: str) -> None:
        self._source = source
        self._key = key
        self._groups: dict[str, int | None] = {}
        self._failed_groups: set[str] = set()
        self._permits: dict[tuple[str, str | None], bool | None] = {}
        self.limit_error: str | None = None
        """Why `limit` is None: what the callback raised or returned, in one line."""
        self.limit: int | None = self._resolve_limit()
        """The key's limit, or None when the callback raised or returned an invalid value."""

    def _resolve_limit(self) -> int | None:
        try:
            value = self._source.limit(self._key)
        except Exception as exc:
            detail = (str(exc).strip().splitlines() or [""])[0]
            self.limit_error = f"limit callback raised {type(exc).__name__}" + (
                f": {detail}" if detail else "")
            return None
        if not _valid_count(value):
            self.limit_error = (f"limit callback returned {value!r:.80}, not a count "
                                f"from 0 to {MAX_COUNT}")
            return None
        return value

    def _resolve_group(self, group: str) -> None:
        try:
            value = self._source.group_limit(self._key, group)
        except Exception:
            self._failed_groups.add(group)
            return
        if value is None or _valid_count(value):
            self._groups[group] = value
        else:
            self._failed_groups.add(group)

    def group_failed(self, group: str | None) -> bool:
        """True when `group_limit` raised or answered nonsense for this group."""
        if group is None:
            return False
        if group not in self._groups and group not in self._failed_groups:
            self._resolve_group(group)
        return group in self._failed_groups

    def group_limit(self, group: str | None) -> int | None:
        """The group's ceiling; None when it has none (check group_failed first)."""
        if group is None or self.group_failed(group):
            return None
        return self._groups[group]

    def resolved_groups(self) -> list[str]:
        """The groups whose ceiling this round has resolved (not those that failed)."""
        return list(self._groups)

    def permitted(self, client_id: str, group: str | None) -> bool | None:
        """`can_grant` for (client, group); None when it raised or answered a non-bool."""
        pair = (client_id, group)
        if pair not in self._permits:
            try:
                answer = self._source.can_grant(self._key, client_id, group)
            except Exception:
                answer = None
            self._permits[pair] = answer if isinstance(answer, bool) else None
        return self._permits[pair]
