# `DurabilitySemaphore`: one semaphore's validated settings, its live limit
# callbacks and its SQL store, around the pure core. Rule: every public call is
# one database transaction (rounds lock their key rows; `run_rounds` runs the
# rounds of many keys in one) that commits before it returns; settings are
# checked once, at construction, naming the setting.
from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, overload

from sqlalchemy import Connection, Engine

from . import store
from .callbacks import (
    CallbackLimits,
    CanGrantCallback,
    GroupLimitCallback,
    KeyLimits,
    LimitCallback,
    check_callable,
)
from .core.clients import Forgotten, forget_client
from .core.config import Leases, RoundConfig, check_caller_seconds, validate_seconds
from .core.round import (
    KeyState,
    Parsed,
    RoundResult,
    parse_messages,
    reclaim,
    run_round,
    with_lease_deadline,
)
from .core.usage import Usage, usage
from .errors import CallerError, ConfigurationError
from .wire.fields import MAX_KEY_LENGTH


class _NoneCommitted(Exception):
    """Every round of a batch failed: the transaction rolls back, with their exceptions."""

    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__("every round of the batch failed")
        self.results = results


class _MigrateEngine(Protocol):
    def __call__(self, engine: Engine | str,
                 target: int | None = ...) -> store.MigrateOutcome: ...


class _MigrateSelf(Protocol):
    def __call__(self, target: int | None = ...) -> store.MigrateOutcome: ...


def _migrate_database(engine: Engine | str,
                      target: int | None = store.SCHEMA_VERSION) -> store.MigrateOutcome:
    if isinstance(engine, Engine):
        return store.migrate(store.prepare_engine(engine), target)
    made = store.create_engine(engine)
    try:
        return store.migrate(made, target)
    finally:
        made.dispose()


class _Migrate:
    """`sem.migrate(target=latest)` on an instance, `DurabilitySemaphore.migrate(engine, target)`
    on the class: create or upgrade the schema, or remove it with `target=None`."""

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> _MigrateEngine: ...

    @overload
    def __get__(self, instance: DurabilitySemaphore, owner: type[Any]) -> _MigrateSelf: ...

    def __get__(self, instance: DurabilitySemaphore | None,
                owner: type[Any]) -> _MigrateEngine | _MigrateSelf:
        if instance is None:
            return _migrate_database
        engine = instance.engine

        def migrate(target: int | None = store.SCHEMA_VERSION) -> store.MigrateOutcome:
            return store.migrate(engine, target)

        return migrate


_IDS_PER_READ = 256


class _Ids(threading.local):
    """Grant and lease ids of this thread not yet handed out."""

    def __init__(self) -> None:
        self.ready: list[str] = []


_IDS = _Ids()
# A forked child must not hand out the ids its parent may hand out too.
os.register_at_fork(after_in_child=lambda: _IDS.ready.clear())


def _new_id() -> str:
    """A fresh id: `uuid.uuid4().hex`, from random bytes read for _IDS_PER_READ ids at a
    time. Each os.urandom lets go of the interpreter lock, and a round thread then waits
    for the other threads' Python to get it back, inside the round's transaction."""
    ready = _IDS.ready
    if not ready:
        raw = os.urandom(16 * _IDS_PER_READ)
        ready.extend(uuid.UUID(bytes=raw[at:at + 16], version=4).hex
                     for at in range(0, len(raw), 16))
    return ready.pop()


class DurabilitySemaphore:
    """A named budget with one holder state per key, kept in SQL (docs/internals.md)."""

    migrate = _Migrate()

    def __init__(
        self,
        name: str,
        *,
        database: str | Engine,
        limit: int | LimitCallback,
        group_limit: GroupLimitCallback | None = None,
        can_grant: CanGrantCallback | None = None,
        round_wait: float = 1.0,
        round_period: float = 2.0,
        grant_timeout: float = 10.0,
        leases: Leases | None = None,
        handoff_window: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = RoundConfig(
            semaphore=name, grant_timeout=grant_timeout, round_wait=round_wait,
            round_period=round_period, leases=leases,
        )
        # A client-side policy (the holder never sees it): how long a worker may pass a
        # finished task's permit straight to its next queued task of the same key and
        # group before the permit must go back to the holder (SemaphoreClient.pass_on).
        self._handoff_window = validate_seconds("handoff_window", handoff_window)
        self._limits = CallbackLimits(limit, group_limit, can_grant)
        check_callable("clock", clock, ())
        self._clock = clock
        if isinstance(database, Engine):
            self._engine, self._owns_engine = store.prepare_engine(database), False
        elif isinstance(database, str):
            self._engine, self._owns_engine = store.create_engine(database), True
        else:
            raise ConfigurationError(
                f"database must be a URL or a SQLAlchemy Engine, got {type(database).__name__}"
            )
        # Key rows carry a revision on PostgreSQL only (store.cache).
        self._cache = store.StateCache() if self._engine.dialect.name == "postgresql" else None

    def __repr__(self) -> str:
        return f"DurabilitySemaphore({self.name!r}, database={self._engine.url!r})"

    @property
    def name(self) -> str:
        return self._config.semaphore

    @property
    def config(self) -> RoundConfig:
        """The validated round settings."""
        return self._config

    @property
    def handoff_window(self) -> float:
        """Seconds a permit may pass from a finished task to the next while others wait
        for its key; 0: one-shot permits."""
        return self._handoff_window

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        """Release database connections (the engine is disposed only if this object made it)."""
        if self._owns_engine:
            self._engine.dispose()

    def _now(self, now: float | None) -> float:
        value = self._clock() if now is None else now
        valid = isinstance(value, int | float) and not isinstance(value, bool)
        if not valid or not math.isfinite(value):
            raise CallerError(f"now must be a finite number of epoch seconds, got {value!r}")
        return float(value)

    @staticmethod
    def _check_key(key: object) -> str:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
            raise CallerError(f"key must be a non-empty string of at most {MAX_KEY_LENGTH} chars")
        return key

    def run_round(self, key: str, messages: Sequence[object], *,
                  now: float | None = None) -> list[dict[str, Any]]:
        """One round for `key`: one response per message, in order, after the commit.

        An invalid message gets an error answer and changes nothing; a database
        failure raises InfrastructureError and changes nothing. `run_rounds` of one key.
        """
        [result] = self.run_rounds([(key, messages)], now=now)
        if isinstance(result, Exception):
            raise result
        return result

    def run_rounds(self, batch: Sequence[tuple[str, Sequence[object]]], *,
                   now: float | None = None) -> list[list[dict[str, Any]] | Exception]:
        """One round for each (key, messages) of `batch`, all in one transaction: per
        item, in order, its responses (as `run_round` gives them) or the exception its
        round raised (a bad key or message list, a failing core), which spoils no other.

        Each key's round is exactly its `run_round`. A database failure raises
        InfrastructureError and changes nothing; a key appears at most once.
        """
        if not isinstance(batch, Sequence) or isinstance(batch, str | bytes):
            raise CallerError(f"batch must be a sequence of (key, messages), got {batch!r}")
        at = self._now(now)
        results: list[list[dict[str, Any]] | Exception | None] = [None] * len(batch)
        todo: dict[str, tuple[int, Parsed, KeyLimits]] = {}
        for index, item in enumerate(batch):
            try:
                key, messages = self._check_round(item, todo)
                # Parsed before BEGIN: parsing reads no state, so the key rows are
                # locked for the round's own work only.
                parsed = parse_messages(messages, semaphore=self.name, key=key)
            except Exception as exc:  # a bad item, or a parser failure: its key alone
                results[index] = exc
                continue
            # Resolved before BEGIN too: a slow limit callback never holds key rows locked.
            todo[key] = (index, parsed, KeyLimits(self._limits, key))
        if todo:
            committed: list[tuple[str, str, KeyState]] = []
            guesses = self._guess(todo, at)

            def body(conn: Connection) -> dict[str, list[dict[str, Any]] | Exception]:
                committed.clear()  # run again on a fresh connection: its own writes only
                return self._rounds(conn, todo, at, committed, guesses)

            try:
                done = store.run_transaction(self._engine, body, write=True)
            except _NoneCommitted as failed:
                done = failed.results
            else:
                if self._cache is not None:
                    self._cache.put(committed)
            for key, result in done.items():
                results[todo[key][0]] = result
        return [r if r is not None else RuntimeError("no result") for r in results]

    def _check_round(self, item: object, todo: dict[str, Any]) -> tuple[str, Sequence[object]]:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise CallerError("each batch item must be a (key, messages) pair")
        key, messages = self._check_key(item[0]), item[1]
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise CallerError("messages must be a list of wire messages")
        if key in todo:
            raise CallerError(f"key {key!r} appears twice in the batch")
        return key, messages

    def _guess(self, todo: dict[str, tuple[int, Parsed, KeyLimits]],
               at: float) -> dict[str, tuple[KeyState, RoundResult]]:
        """Each key's round run before BEGIN on the state this process last committed for
        it (the cache's; a key it never committed, the empty state of a new key), so that
        the transaction waits on none of the core's Python when nobody wrote the key
        since: `_rounds` keeps a guess only if the locked key row yields that state."""
        guesses: dict[str, tuple[KeyState, RoundResult]] = {}
        if self._cache is None:
            return guesses
        for key, (_, messages, limits) in todo.items():
            state = self._cache.peek(key) or KeyState(semaphore=self.name, key=key)
            try:
                guesses[key] = (state, run_round(state, messages, config=self._config,
                                                 limits=limits, now=at, new_id=_new_id))
            except Exception:  # the round in the transaction raises it, and answers it
                continue
        return guesses

    def _rounds(self, conn: Connection, todo: dict[str, tuple[int, Parsed, KeyLimits]],
                at: float, committed: list[tuple[str, str, KeyState]],
                guesses: dict[str, tuple[KeyState, RoundResult]],
                ) -> dict[str, list[dict[str, Any]] | Exception]:
        """The body of `run_rounds`' transaction (run again if its connection was dead);
        `committed` gets (key, revision, state) of each key saved, for the cache once
        the transaction has committed. A key whose state is the one its guess started
        from takes the guess: the round is pure, so it is what running it here gives
        (the cache hands the very object it guessed on; a new key an equal one)."""
        olds = store.load_many(conn, self.name, todo, cache=self._cache)
        done: dict[str, list[dict[str, Any]] | Exception] = {}
        changes = []
        for key, (_, messages, limits) in todo.items():
            old, guess = olds[key], guesses.get(key)
            try:
                result = (guess[1] if guess is not None and (guess[0] is old or guess[0] == old)
                          else run_round(old, messages, config=self._config, limits=limits,
                                         now=at, new_id=_new_id))
            except Exception as exc:  # this key's round fails alone
                done[key] = exc
                continue
            changes.append((old, result.state))
            done[key] = list(result.responses)
        if not changes:
            raise _NoneCommitted(done)  # roll back the key rows a failed first round made
        revisions = store.save_many(conn, changes, now=at)
        committed.extend((new.key, revisions[new.semaphore, new.key], new)
                         for _, new in changes if (new.semaphore, new.key) in revisions)
        unused = [key for key, result in done.items()
                  if isinstance(result, Exception) and olds[key].rounds == 0]
        if unused:
            store.forget_unused_keys(conn, self.name, unused)
        return done

    def reclaim(self, key: str, *, now: float | None = None) -> float | None:
        """Reclaim expired unclaimed grants of `key`; returns its next claim deadline or None."""
        key = self._check_key(key)
        at = self._now(now)

        def body(conn: Connection) -> float | None:
            old = store.read(conn, self.name, key, lock=True)
            if old is None:
                return None  # never had a round: nothing to reclaim
            new = reclaim(old, config=self._config, now=at)
            store.save(conn, old, new, now=at)
            return new.next_claim_deadline

        return store.run_transaction(self._engine, body, write=True)

    def state(self, key: str) -> KeyState:
        """A consistent snapshot of `key`'s holder state (empty if it never had a round)."""
        key = self._check_key(key)
        found = store.run_transaction(
            self._engine, lambda conn: store.read(conn, self.name, key), write=False)
        return found if found is not None else KeyState(semaphore=self.name, key=key)

    def usage(self, key: str, *, now: float | None = None) -> Usage:
        """Limit, outstanding permits, lease footprint, per-group usage and blocked demand."""
        at = self._now(now)
        return usage(self.state(key), config=self._config, limits=self._limits, now=at)

    def due_deadlines(self, *, now: float | None = None) -> list[tuple[str, float]]:
        """(key, deadline) of keys whose next deadline (see `deadlines`) is at or before `now`."""
        at = self._now(now)
        return store.run_transaction(
            self._engine, lambda conn: store.deadlines(conn, self.name, due_by=at), write=False)

    def deadlines(self) -> list[tuple[str, float]]:
        """(key, next deadline) of every key with unclaimed grant permits or unacknowledged
        leases (when time alone changes it: see KeyState.next_claim_deadline), earliest first."""
        return store.run_transaction(
            self._engine, lambda conn: store.deadlines(conn, self.name), write=False)

    def keys(self) -> list[str]:
        """Every key of this semaphore that has had a round."""
        with store.transaction(self._engine, write=False) as conn:
            return [key for _, key in store.all_keys(conn, self.name)]

    def check_idle_for(self, idle_for: float) -> None:
        """CallerError unless `idle_for` may prune this semaphore (see prune): a caller
        pruning several semaphores checks them all before the first delete."""
        valid = isinstance(idle_for, int | float) and not isinstance(idle_for, bool)
        if not valid or not math.isfinite(idle_for) or idle_for < self._config.round_period:
            raise CallerError(f"idle_for must be a number of seconds >= round_period "
                              f"({self._config.round_period:g}), got {idle_for!r}")

    def prune(self, *, idle_for: float, batch: int = 1000, now: float | None = None) -> int:
        """Delete the rows of keys that hold nothing (no grant, lease or client) and had no
        round for `idle_for` seconds (at least `round_period`); returns how many.

        Key rows are never deleted otherwise, so a semaphore whose keys come and go (one
        per job, per document) grows its table for ever. A pruned key loses nothing a
        round needs: its next round is a first round, `round_wait` after its request. Safe
        while holders run: rows a round holds are skipped, and a round that waits for a
        row being pruned starts the key afresh. Each `batch` of rows is one transaction.
        """
        at = self._now(now)
        self.check_idle_for(idle_for)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise CallerError(f"batch must be a positive integer, got {batch!r}")
        total = 0
        while True:
            with store.transaction(self._engine, write=True) as conn:
                deleted = store.prune_keys(conn, self.name, idle_before=at - idle_for,
                                           limit=batch)
            total += deleted
            if deleted < batch:  # fewer than asked: nothing more was idle, or locked now
                return total

    def silent_clients(self, *, silent_for: float,
                       now: float | None = None) -> dict[str, list[str]]:
        """Clients holding grants or leases that no holder has heard from for `silent_for`
        seconds, with the keys where they hold something. Silence alone proves nothing (a
        long task on a grant sends no reports): confirm a client is gone before forgetting it.
        """
        at = self._now(now) - check_caller_seconds("silent_for", silent_for)
        found: dict[str, list[str]] = {}
        with store.transaction(self._engine, write=False) as conn:
            for client_id, key, _ in store.silent_clients(conn, self.name, before=at):
                found.setdefault(client_id, []).append(key)
        return found

    def forget_client(self, key: str, client_id: str, *, silent_for: float,
                      now: float | None = None) -> Forgotten | None:
        """Settle a client confirmed gone: drop its grants and leases of `key`.

        Re-checked under the key's lock: a client heard from within `silent_for`
        (it came back since it was found silent) is left alone and None returned.
        """
        key = self._check_key(key)
        if not isinstance(client_id, str) or not client_id:
            raise CallerError(f"client_id must be a non-empty string, got {client_id!r}")
        silence = check_caller_seconds("silent_for", silent_for)
        at = self._now(now)
        with store.transaction(self._engine, write=True) as conn:
            old = store.read(conn, self.name, key, lock=True)
            seen = {c.client_id: c.last_seen_at for c in old.clients} if old else {}
            if old is None or client_id not in seen or seen[client_id] >= at - silence:
                return None
            new, forgotten = forget_client(old, client_id)
            store.save(conn, old, with_lease_deadline(new, self._config), now=at)
        return forgotten


_CONFORMS: type[store.Store] = DurabilitySemaphore  # mypy checks the contract here
