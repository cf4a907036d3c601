# Error replies, holder to client: what a message gets in place of a round's
# response when the holder refuses it. Codes: `invalid_message` (validation
# failed, nothing changed), `unknown_semaphore` (this holder does not serve it),
# `unavailable` (overloaded, or the database failed; ask again later).
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidMessage
from .fields import VERSION


@dataclass(frozen=True)
class ErrorReply:
    """The holder refused the message (`invalid_message`, `unknown_semaphore`, `unavailable`)."""

    code: str
    message: str


def error_reply(code: str, message: str) -> dict[str, Any]:
    """An error answer of the wire protocol (docs/internals.md, "Wire")."""
    return {"v": VERSION, "error": {"code": code, "message": message}}


def error_response(exc: InvalidMessage) -> dict[str, Any]:
    """What a rejected message gets in place of a round's response."""
    return error_reply(exc.code, str(exc))


def parse_error(error: object) -> ErrorReply:
    """The `error` member of a reply, as the client reads it: any code and message,
    kept as text."""
    if not isinstance(error, Mapping):
        raise InvalidMessage("error", "must be an object")
    return ErrorReply(code=str(error.get("code", "unknown")),
                      message=str(error.get("message", "")))


# --- hints: what a built answer says, read without validation ------------------


def is_error(raw: Mapping[str, Any]) -> bool:
    """Whether an answer is an error reply rather than a round's response."""
    return "error" in raw


def error_message_of(raw: Mapping[str, Any]) -> str | None:
    """The message of an error reply, if it carries one as text."""
    error = raw.get("error")
    message = error.get("message") if isinstance(error, Mapping) else None
    return message if isinstance(message, str) else None
