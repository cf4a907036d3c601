# The one place for behaviour that differs between the supported Celery and
# kombu releases (celery >=5.4,<5.8, kombu >=5.4.2,<5.8). Rule: each shim tests
# for the kombu feature it stands in for, never for a version number, and cites
# the upstream change it works around; the version range is checked once, where
# the library is wired into an app (Durability.__init__).
from __future__ import annotations

import re
import uuid
from contextlib import AbstractContextManager
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .errors import ConfigurationError

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


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise ConfigurationError (one line) when the installed celery or kombu is outside
    SUPPORTED; `installed` (name -> version) replaces the installed distributions."""
    for name, (low, high) in SUPPORTED.items():
        found = installed.get(name) if installed is not None else _installed(name)
        if found is None or not low <= _release(found) < high:
            raise ConfigurationError(
                f"durability-celery supports {name} >={_dotted(low)},<{_dotted(high)}; "
                f"installed: {found or 'none'}")


# kombu < 5.7 has no Producer.batch (added by kombu PR #2572), so there a
# publish always goes out at once.
def open_publish_batch(producer: Any) -> AbstractContextManager[Any] | None:
    """`producer.batch()` (not yet entered), or None where kombu has no batches:
    publish at once."""
    batch = getattr(producer, "batch", None)
    return None if batch is None else batch()


# kombu's Redis transport ignores a queue's x-expires before kombu PR #2251
# (kombu 5.7): a reply queue whose client went away would never expire. There
# the publisher sets the expiry itself after each push, as 5.7 does.
def redis_applies_queue_expiry(channel: Any) -> bool:
    """True when this Redis channel PEXPIREs a queue declared with x-expires on each push."""
    return hasattr(channel, "_get_queue_expire")


def expire_redis_queue(channel: Any, queue: str, milliseconds: int) -> None:
    """PEXPIRE every priority list of `queue` on this Redis channel (one round trip)."""
    with channel.conn_or_acquire() as client, client.pipeline() as pipe:
        for priority in channel.priority_steps:
            pipe.pexpire(channel._q_for_pri(queue, priority), milliseconds)
        pipe.execute()


# kombu's filesystem Channel computes an exchange's table file in
# Channel._exchange_file only since kombu PR #2645 (5.7, which also validates
# the name); before, the same path is written inline.
def exchange_file(channel: Any, exchange: str) -> Path:
    """The file holding `exchange`'s bindings in this filesystem channel's control folder."""
    method = getattr(channel, "_exchange_file", None)
    if method is not None:
        return method(exchange)  # type: ignore[no-any-return]
    return Path(channel.control_folder) / f"{exchange}.exchange"


# Before kombu 5.7 (kombu #2646, fixed by #2647) the filesystem transport takes
# any file whose name contains ".<queue>.msg" as a message of that queue, so a
# temporary file must not contain it anywhere, or a reader picks it up half-written.
def temporary_beside(final: Path) -> Path:
    """A fresh temporary path in `final`'s folder that no filesystem queue reads."""
    return final.with_name(f".tmp-{uuid.uuid4().hex}")
