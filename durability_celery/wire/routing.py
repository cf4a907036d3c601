# Where messages for a (semaphore, key) go: a stable hash maps keys onto a fixed
# number of holder shards, so ten thousand accounts do not mean ten thousand
# queues, and the names of the holder, control and reply queues. The mapping must
# never depend on the process (no built-in hash()).
from __future__ import annotations

import re
import zlib

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def shard_for(semaphore: str, key: str, shards: int) -> int:
    """The holder shard that serves (semaphore, key)."""
    return zlib.crc32(f"{semaphore}\0{key}".encode()) % shards


def holder_queue(prefix: str, shard: int) -> str:
    """Name of the queue a holder consumes for one shard."""
    return f"{prefix}.holder.{shard}"


def control_queue(prefix: str) -> str:
    """Queue for holder-side maintenance tasks (beat's reclaim), consumed by holder workers."""
    return f"{prefix}.holder.control"


def reply_queue(prefix: str, client_id: str) -> str:
    """Per-client reply queue; declared with `expires` so a gone client's queue goes too."""
    return f"{prefix}.reply.{client_id}"


def safe_queue_part(text: str) -> str:
    """`text` usable inside a queue name on every transport (the filesystem
    transport puts queue names in file names, so no slashes)."""
    return _UNSAFE.sub("_", text)[:120]
