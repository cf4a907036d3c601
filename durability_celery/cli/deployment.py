# What `why` and `top` read from a running deployment: the user's app and its
# Durability configuration, the client workers' answers to the gate's inspect
# commands (durability_held, durability_task, durability_ahead: see
# worker/visibility.py), and the holder's usage of a key. Rule: read-only; an
# unreachable broker or database is one ConfigurationError line, never a hang.
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..app import Durability, durability_for
from ..core.keystate import KeyState
from ..core.usage import Usage
from ..errors import ConfigurationError
from ..semaphore import DurabilitySemaphore

INSPECT_TIMEOUT = 1.0
"""Seconds to wait for the workers' answers (Celery's own inspect default)."""
NO_GATE = "no durability gate in this worker"
"""What a worker without a gate (the holder) answers the gate's inspect commands."""


@dataclass
class Deployment:
    """The user's app, its Durability configuration and the workers that answered."""

    app: Any
    durability: Durability
    timeout: float = INSPECT_TIMEOUT
    answered: list[str] = field(default_factory=list)
    """Every node that answered the last broadcast (holder included)."""

    def semaphore(self, name: str) -> DurabilitySemaphore:
        return self.durability.semaphore(name)

    def ask(self, command: str, arguments: dict[str, Any] | None = None, *,
            expect: int | None = None) -> dict[str, dict[str, Any]]:
        """`command` on every worker: the answers of the client workers (those with a
        gate), by node name. `expect`: stop waiting once this many nodes answered."""
        try:
            replies = self.app.control.broadcast(
                command, arguments=arguments or {}, reply=True, timeout=self.timeout,
                limit=expect)
        except self._broker_errors() as exc:
            raise ConfigurationError(f"broker unreachable ({self.broker()}): {exc}") from None
        answers: dict[str, dict[str, Any]] = {}
        for reply in replies or []:
            answers.update(reply)
        self.answered = sorted(answers)
        return {node: answer for node, answer in answers.items()
                if isinstance(answer, dict) and answer.get("error") != NO_GATE}

    def broker(self) -> str:
        """The broker URL, password hidden (for error lines)."""
        from kombu.utils.url import maybe_sanitize_url

        return str(maybe_sanitize_url(self.app.conf.broker_url or "amqp://"))

    def _broker_errors(self) -> tuple[type[BaseException], ...]:
        """What a lost broker raises: kombu's own errors and its transport's."""
        from kombu.exceptions import OperationalError

        with self.app.connection_for_write() as connection:
            return (OperationalError, OSError, *connection.connection_errors)

    def check_broker(self) -> None:
        """Fail at once, with one line, when the broker cannot be reached."""
        try:
            with self.app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, timeout=5)
        except self._broker_errors() as exc:
            raise ConfigurationError(f"broker unreachable ({self.broker()}): {exc}") from None

    def usage(self, semaphore: str, key: str) -> Usage:
        try:
            return self.semaphore(semaphore).usage(key)
        except Exception as exc:
            raise _database_error(exc) from None

    def state(self, semaphore: str, key: str) -> KeyState:
        try:
            return self.semaphore(semaphore).state(key)
        except Exception as exc:
            raise _database_error(exc) from None

    def close(self) -> None:
        for sem in self.durability.semaphores.values():
            sem.close()


def _database_error(exc: Exception) -> Exception:
    """One line for what the user can act on (the database down); a bug stays as it is."""
    from .commands import describe_error

    message = describe_error(exc)
    return exc if message is None else ConfigurationError(message)


@contextmanager
def deployment_of(args: argparse.Namespace) -> Iterator[Deployment]:
    """The deployment --app names, its schema and broker checked; closed afterwards."""
    from .commands import _import_app, _require_schema

    app = _import_app(args.app)
    found = Deployment(app, durability_for(app), timeout=args.timeout)
    try:
        if not found.durability.semaphores:
            raise ConfigurationError(f"--app {args.app!r} configures no semaphores")
        _require_schema(next(iter(found.durability.semaphores.values())))
        found.check_broker()
        yield found
    finally:
        found.close()


# --------------------------------------------------------------------------
# what the workers hold, per key (for `top`)


@dataclass
class GroupActivity:
    held: int = 0
    running: int = 0
    blocked: set[str] = field(default_factory=set)


@dataclass
class KeyActivity:
    """One (semaphore, key) summed over the client workers' `durability_held` rows."""

    semaphore: str
    key: str
    held: int = 0
    running: int = 0
    oldest_wait: float | None = None
    workers: set[str] = field(default_factory=set)
    groups: dict[str | None, GroupActivity] = field(default_factory=dict)
    errors: set[str] = field(default_factory=set)

    def add(self, node: str, row: dict[str, Any]) -> None:
        group = self.groups.setdefault(row.get("group"), GroupActivity())
        held, running = int(row.get("held") or 0), int(row.get("running") or 0)
        group.held += held
        group.running += running
        self.held += held
        self.running += running
        self.workers.add(node)
        if row.get("blocked"):
            group.blocked.add(str(row["blocked"]))
        if row.get("error"):
            self.errors.add(str(row["error"]))
        wait = row.get("oldest_wait")
        if isinstance(wait, int | float) and (self.oldest_wait is None
                                              or wait > self.oldest_wait):
            self.oldest_wait = float(wait)


def key_activity(answers: dict[str, dict[str, Any]]) -> list[KeyActivity]:
    """Every key some worker holds or runs tasks of, busiest first: most tasks held and
    running, then the longest wait."""
    found: dict[tuple[str, str], KeyActivity] = {}
    for node, answer in sorted(answers.items()):
        for row in answer.get("keys") or []:
            where = (str(row["semaphore"]), str(row["key"]))
            found.setdefault(where, KeyActivity(*where)).add(node, row)
    return sorted(found.values(), key=lambda k: (-(k.held + k.running),
                                                 -(k.oldest_wait or 0.0), k.semaphore, k.key))
