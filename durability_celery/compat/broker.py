# kombu's publishing and the filesystem transport's paths: the four places where
# kombu 5.7 differs from 5.4-5.6 for the holder and the embedded broker. Each is
# chosen once, at import, by the installed kombu (compat.KOMBU); both choices of
# each are tested (tests/test_compat.py). No kombu import: these act on the
# objects they are given.
from __future__ import annotations

import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from . import KOMBU

_KOMBU_5_7 = KOMBU >= (5, 7)


# kombu < 5.7 has no Producer.batch (added by kombu PR #2572), so there a
# publish always goes out at once.
def batch_of(producer: Any) -> AbstractContextManager[Any] | None:
    """`producer.batch()` (not yet entered): kombu 5.7."""
    return producer.batch()  # type: ignore[no-any-return]


def no_batch(producer: Any) -> AbstractContextManager[Any] | None:
    """None: kombu < 5.7 has no batches, each publish goes out at once."""
    return None


open_publish_batch = batch_of if _KOMBU_5_7 else no_batch
"""A producer's publish batch, not yet entered; None where kombu has none."""


# kombu's Redis transport ignores a queue's x-expires before kombu PR #2251
# (kombu 5.7): a reply queue whose client went away would never expire. There
# the publisher sets the expiry itself after each push, as 5.7 does.
def redis_applies_queue_expiry(channel: Any) -> bool:
    """True when this kombu's Redis channel PEXPIREs a queue declared with x-expires on
    each push (kombu 5.7: `Channel._get_queue_expire`)."""
    return _KOMBU_5_7


def expire_redis_queue(channel: Any, queue: str, milliseconds: int) -> None:
    """PEXPIRE every priority list of `queue` on this Redis channel (one round trip);
    the list names come from the channel's private `_q_for_pri`, as kombu names them."""
    with channel.conn_or_acquire() as client, client.pipeline() as pipe:
        for priority in channel.priority_steps:
            pipe.pexpire(channel._q_for_pri(queue, priority), milliseconds)
        pipe.execute()


# kombu's filesystem Channel computes an exchange's table file in
# Channel._exchange_file only since kombu PR #2645 (5.7, which also validates
# the name); before, the same path is written inline.
def kombus_exchange_file(channel: Any, exchange: str) -> Path:
    """kombu 5.7's own `Channel._exchange_file`."""
    return channel._exchange_file(exchange)  # type: ignore[no-any-return]


def local_exchange_file(channel: Any, exchange: str) -> Path:
    """The path kombu < 5.7 writes inline."""
    return Path(channel.control_folder) / f"{exchange}.exchange"


exchange_file = kombus_exchange_file if _KOMBU_5_7 else local_exchange_file
"""The file holding an exchange's bindings in a filesystem channel's control folder."""


# Before kombu 5.7 (kombu #2646, fixed by #2647) the filesystem transport takes
# any file whose name contains ".<queue>.msg" as a message of that queue, so a
# temporary file must not contain it anywhere, or a reader picks it up half-written.
# The name is safe on every release, so there is one implementation.
def temporary_beside(final: Path) -> Path:
    """A fresh temporary path in `final`'s folder that no filesystem queue reads."""
    return final.with_name(f".tmp-{uuid.uuid4().hex}")
