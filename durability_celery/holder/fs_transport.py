# kombu's filesystem transport with atomic writes, registered as the broker URL
# scheme `durability-filesystem://` (same transport options as `filesystem://`).
# Why: kombu 5.7's filesystem `_put` creates the message file and then writes
# it, while a reader in another process may already move and read it: the
# reader gets an empty file and the message is lost (seen in the holder tests,
# about 1 message in 100). Here a message is written under a name no reader
# picks up and renamed into place, so readers only ever see complete files.
from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

SCHEME = "durability-filesystem"


class Channel(filesystem.Channel):
    # kombu itself names the argument differently in its two base classes.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # Readers pick files named "<prefix>.<queue>.msg"; this name never matches.
        partial = os.path.join(self.data_folder_out, f"{uuid.uuid4().hex}.partial")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    """Make `durability-filesystem://` broker URLs resolve to this transport."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
