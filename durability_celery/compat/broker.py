# kombu's publishing and the filesystem transport's paths: the four places where
# kombu 5.7 differs from 5.4-5.6 for the holder and the embedded broker. Each is
# chosen once, at import, by the installed kombu (compat.KOMBU); both choices of
# each are tested (tests/test_compat.py). No kombu import: these act on the
# objects they are given.
from __future__ import annotations

import uuid
from collections.abc import Callable
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


# kombu's Redis transport has no public way to name the lists a queue lives in, to
# take entries other than by its own BRPOP, or to choose its delivery tags; the
# holder's intake and replies need all three (holder/intake.py, holder/replies.py).
def redis_lists(channel: Any, queue_names: list[str]) -> list[tuple[str, str]]:
    """(list key, queue) of every Redis list kombu keeps `queue_names` in, in its BRPOP
    order: every queue's list of the first priority, then the next (the channel's
    private `_q_for_pri` and `priority_steps`)."""
    return [(channel._q_for_pri(name, priority), name)
            for priority in channel.priority_steps for name in queue_names]


def redis_deliver(channel: Any) -> Callable[[Any, str], None]:
    """The transport's own delivery of a raw payload taken from a queue's list to the
    channel's consumers, as after its BRPOP (`Transport._deliver`)."""
    deliver: Callable[[Any, str], None] = channel.connection._deliver
    return deliver


def tag_deliveries(channel: Any, make_tag: Callable[[], str]) -> None:
    """Have this Redis channel tag each message it publishes with `make_tag()` (its
    private `_next_delivery_tag`, a fresh uuid4 per message)."""
    channel._next_delivery_tag = make_tag


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
