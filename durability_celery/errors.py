# The one root of every error this library raises, split by who is at fault:
# the caller (a bad message or argument), configuration, or infrastructure.
from __future__ import annotations


class DurabilityError(Exception):
    """Root of every error raised by durability-celery."""


class CallerError(DurabilityError):
    """The caller passed something invalid; nothing was changed."""


class InvalidMessage(CallerError):
    """A wire message failed validation; it was answered with an error and changed nothing."""

    code = "invalid_message"

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class IllegalTransition(CallerError):
    """A grant or lease was asked to make a move its state machine forbids."""

    def __init__(self, kind: str, ident: str, state: str, event: str) -> None:
        self.kind = kind
        self.ident = ident
        self.state = state
        self.event = event
        super().__init__(f"{kind} {ident!r} in state {state!r} cannot take event {event!r}")


class ConfigurationError(DurabilityError):
    """A setting is missing or out of its allowed range; raised at start-up."""


class InfrastructureError(DurabilityError):
    """The database or broker failed; the operation may be retried."""


class SchemaMissing(InfrastructureError):
    """The database has no durability tables: `durability-celery migrate` never ran on it.

    An InfrastructureError, as clients should ask again: it serves once migrated."""


class RequestTimeout(InfrastructureError):
    """The holder did not answer a request within its timeout."""


class HolderError(InfrastructureError):
    """The holder answered a request with an error instead of a round's response."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")
