# The embedded broker: kombu's filesystem transport with atomic writes
# (compat/filesystem.py, which says why), registered as the broker URL scheme
# `durability-filesystem://` (same transport options as `filesystem://`): the
# demo's broker, worker_config's default and the examples'. Rule: a consumer
# never sees a half-written file.
from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from .compat.filesystem import Channel, Transport

SCHEME = "durability-filesystem"

__all__ = ["SCHEME", "Channel", "Transport", "register"]


def register() -> None:
    """Make `durability-filesystem://` broker URLs resolve to this transport (idempotent)."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
