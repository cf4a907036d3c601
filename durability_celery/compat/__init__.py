# The one place for every private or undocumented Celery and kombu hook the gate,
# the holder and the embedded broker rely on, and for what differs between the
# supported releases (celery >=5.4,<5.8, kombu >=5.4.2,<5.8). Rules: nothing
# outside this package touches an underscore attribute of Celery or kombu, nor
# celery.worker.state, strategy, Request or transport internals; each hook says
# in a sentence why it is needed and cites the upstream issue or source it works
# around; where releases differ, the implementation is chosen once, here at
# import, by the installed release (tests/test_compat.py checks each choice
# against the installed kombu's features, on every release scripts/versions runs);
# the version range is checked once, where the library is wired into an app
# (Durability.__init__), and an unsupported release stops it with one line.
#
#   compat/__init__.py  the version check and the installed releases
#   compat/broker.py    kombu publishing and the filesystem transport's paths
#   compat/filesystem.py  kombu's filesystem channel with atomic writes
#   compat/pushes.py    messages pushed on Redis by hand (holder replies, gate requests)
#   compat/redis_qos.py kombu's virtual and Redis QoS (unacked records, restore)
#   compat/wire.py      kombu's wire text: a message pushed on Redis, JSON decoding
#   compat/worker.py    Celery's worker: state, strategy, consumer, pools, requests
#
# Only this module and broker.py load at import: the others import Celery's
# worker or kombu's transports or utilities, which a plain producer process never
# needs.
from __future__ import annotations

import re
from functools import cache
from importlib.metadata import PackageNotFoundError, version

from ..errors import ConfigurationError

SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "celery": ((5, 4), (5, 8)),
    "kombu": ((5, 4, 2), (5, 8)),
}
"""Distribution -> (lowest supported release, first unsupported release)."""


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


@cache
def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


CELERY: tuple[int, ...] = _release(_installed("celery") or "")
"""The installed Celery release, e.g. (5, 7, 0); () if none is installed."""
KOMBU: tuple[int, ...] = _release(_installed("kombu") or "")
"""The installed kombu release; the shims of broker.py are chosen by it."""


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise ConfigurationError (one line) when the installed celery or kombu is outside
    SUPPORTED; `installed` (name -> version) replaces the installed distributions."""
    for name, (low, high) in SUPPORTED.items():
        found = installed.get(name) if installed is not None else _installed(name)
        if found is None or not low <= _release(found) < high:
            raise ConfigurationError(
                f"durability-celery supports {name} >={_dotted(low)},<{_dotted(high)}; "
                f"installed: {found or 'none'}")


# Re-exported: the holder's reply publisher and the embedded broker call them as
# compat.NAME.
from .broker import (  # noqa: E402
    exchange_file,
    open_publish_batch,
    redis_deliver,
    redis_lists,
    tag_deliveries,
    temporary_beside,
)

__all__ = [
    "CELERY", "KOMBU", "SUPPORTED", "check_versions",
    "exchange_file", "open_publish_batch", "redis_deliver", "redis_lists", "tag_deliveries",
    "temporary_beside",
]
