# The limits of the wire and the field readers both directions share. A field
# that fails raises InvalidMessage naming it; reading never changes any state.
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from ..errors import InvalidMessage

VERSION = 1
MAX_ID_LENGTH = 200
"""Longest semaphore name, client id, group or grant/lease id: the width of the store's
columns, so a longer one could never be saved."""
MAX_KEY_LENGTH = MAX_ID_LENGTH
"""Longest key: the width of the store's key column, so a longer one could never be saved."""
MAX_COUNT = 1_000_000_000
"""Upper bound for any count on the wire or in settings; larger is absurd."""
MAX_ROUND = 2**63 - 1
"""Largest round number of a key (the store keeps it as a signed 64-bit integer)."""
MAX_ENTRIES = 10_000
"""Most demand entries, grant reports or lease reports one message may carry."""


def is_object(value: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether `value` is a JSON object. A decoded message is made of dicts: they are
    spared the slower Mapping check."""
    return type(value) is dict or isinstance(value, Mapping)


def required(obj: Mapping[str, Any], name: str, where: str) -> Any:
    """`obj[name]`; InvalidMessage naming `where` + `name` if it is absent."""
    if name not in obj:
        raise InvalidMessage(f"{where}{name}", "is required")
    return obj[name]


def ident(value: Any, field: str, name: str = "") -> str:
    """`value` if it is an id the store can save (a non-empty string, not too long). The
    field is named `field` + `name`, joined only for an error."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise InvalidMessage(f"{field}{name}",
                             f"must be a non-empty string of at most {MAX_ID_LENGTH} chars")
    return value


def optional_ident(value: Any, field: str, name: str = "") -> str | None:
    """None, or an id as `ident` takes it (a group: None is the key's default group)."""
    return None if value is None else ident(value, field, name)


def optional_round(value: Any, field: str) -> int | None:
    """None (absent: an older peer), or a key's round number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ROUND:
        raise InvalidMessage(field, f"must be an integer between 0 and {MAX_ROUND}")
    return value


# --- lenient readers: what the hints of request.py and reply.py share ---------
# A field missing or of the wrong kind reads as nothing, never as an error.


def number_or_none(value: Any) -> float | None:
    """`value` as a float if it is a JSON number (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def int_or_zero(value: Any) -> int:
    """`value` if it is an integer (not a boolean), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def objects_in(raw: Mapping[str, Any], name: str) -> Iterator[Mapping[str, Any]]:
    """The objects in the list `raw[name]`, skipping anything else; none if it is no list."""
    entries = raw.get(name)
    if isinstance(entries, list):
        yield from (entry for entry in entries if is_object(entry))
