# kombu's filesystem transport with atomic writes, behind the embedded broker
# `durability-filesystem://` (durability_celery/transport.py registers it). It
# overrides two private methods of kombu's filesystem Channel, `_put` and
# `_queue_bind`, so it lives here.
#
# Why: kombu's filesystem transport creates a message file, then locks and
# writes it, while consumers move and read files without taking the lock; a
# consumer that picks a file up between create and write reads b"" and the
# message is lost or the worker dies with JSONDecodeError (the empty-message
# decode error of kombu #1551). The same happens to an exchange file that two
# processes create at once. Here both are written under a name no reader picks
# up and renamed (or hard-linked) into place, so readers see all or nothing.
from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils import json as kombu_json

from .broker import exchange_file, temporary_beside

# kombu's own encoder (it handles the types kombu puts into a payload).
_dumps: Any = kombu_json.dumps


def _write_atomically(final: Path, data: bytes, *, replace: bool) -> bool:
    """Write `data` to `final` all at once; with replace=False, only if it does not exist."""
    tmp = temporary_beside(final)
    tmp.write_bytes(data)
    try:
        if replace:
            os.replace(tmp, final)
            return True
        try:
            os.link(tmp, final)  # fails if another process created it first
        except FileExistsError:
            return False
        return True
    finally:
        if tmp.exists():
            tmp.unlink()


class Channel(filesystem.Channel):
    # kombu itself declares _put twice with different parameter names.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        # Readers pick files named "<prefix>.<queue>.msg"; the temporary name never matches.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        try:
            _write_atomically(Path(self.data_folder_out) / name,
                              str(_dumps(payload)).encode(), replace=True)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        file = exchange_file(self, exchange)
        if not file.exists():
            self.control_folder.mkdir(exist_ok=True)
            _write_atomically(file, b"[]", replace=False)
        # The file exists now: kombu's locked read-modify-write path adds the binding.
        bind: Any = super()._queue_bind
        bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    Channel = Channel
