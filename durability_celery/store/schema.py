# The SQL tables of durability-celery, declared once with SQLAlchemy Core, and
# `migrate`, which creates, upgrades or removes them. Rule: the schema is the
# only place column names live; `metadata` is public so Alembic users can
# include it in their own migrations.
from __future__ import annotations

from typing import Literal

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    insert,
    select,
    text,
    true,
    update,
)
from sqlalchemy.engine import Connection

from ..errors import ConfigurationError
from ..wire.fields import MAX_ID_LENGTH

SCHEMA_VERSION = 4
"""The version `migrate(engine)` brings a database to."""

MigrateOutcome = Literal["created", "upgraded", "current", "removed", "absent"]
"""What `migrate` did: created the schema, upgraded it, found it current (nothing
changed), removed it, or found none to remove."""

NAME_LENGTH = MAX_ID_LENGTH
"""Longest semaphore name, key, client id, group or grant/lease id (as on the wire)."""

metadata = MetaData()

# Ids are unique only within (semaphore, key): a client may report a lease id
# the holder never issued, and that row must not collide with another key's.
grants = Table(
    "durability_semaphore_grants",
    metadata,
    Column("semaphore", String(NAME_LENGTH), primary_key=True),
    Column("key", String(NAME_LENGTH), primary_key=True),
    Column("grant_id", String(NAME_LENGTH), primary_key=True),
    Column("client_id", String(NAME_LENGTH), nullable=False),
    Column("group", String(NAME_LENGTH), nullable=True),
    Column("permits", Integer, nullable=False),
    Column("claimed", Integer, nullable=False),
    Column("released", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("claim_deadline", Double, nullable=False),
    Column("status", String(16), nullable=False),
    Index("ix_durability_semaphore_grants_client", "client_id"),
)

leases = Table(
    "durability_semaphore_leases",
    metadata,
    Column("semaphore", String(NAME_LENGTH), primary_key=True),
    Column("key", String(NAME_LENGTH), primary_key=True),
    Column("lease_id", String(NAME_LENGTH), primary_key=True),
    Column("client_id", String(NAME_LENGTH), nullable=False),
    Column("group", String(NAME_LENGTH), nullable=True),
    Column("permits", Integer, nullable=False),
    Column("drawn", Integer, nullable=False),
    Column("released", Integer, nullable=False),
    Column("issued_at", Double, nullable=False),
    Column("last_report_at", Double, nullable=False),
    Column("status", String(16), nullable=False),
    Column("confirmed", Boolean, nullable=False),
    Column("issued_limit", Integer, nullable=False),
    Column("issued_group_limit", Integer, nullable=True),
    Column("acknowledged", Boolean, nullable=False, server_default=true()),
    Column("issued_round", BigInteger, nullable=False, server_default=text("0")),
    Index("ix_durability_semaphore_leases_client", "client_id"),
)

# Keys with a deadline, for the holder's timer and beat. Partial, so it cannot serve a
# lookup by (semaphore, key): on a table not yet analyzed PostgreSQL took the whole
# index, matched on the semaphore alone, for each key a round locks, and a batch's
# lock cost grew with every key of the semaphore.
_DEADLINE_WHERE = text("next_claim_deadline IS NOT NULL")

# One row per (semaphore, key): the row a round locks, plus what the holder's
# timer and beat need without reading every grant.
keys = Table(
    "durability_semaphore_keys",
    metadata,
    Column("semaphore", String(NAME_LENGTH), primary_key=True),
    Column("key", String(NAME_LENGTH), primary_key=True),
    Column("last_round_at", Double, nullable=True),
    Column("rounds", BigInteger, nullable=False, default=0),
    Column("limit", Integer, nullable=True),
    Column("next_claim_deadline", Double, nullable=True),
    Column("blocked", Text, nullable=False, default="[]"),
    Column("updated_at", Double, nullable=True),
    Index("ix_durability_semaphore_keys_deadline", "semaphore", "next_claim_deadline",
          postgresql_where=_DEADLINE_WHERE, sqlite_where=_DEADLINE_WHERE),
)

# Clients holding grants or leases of a key, and when each was last heard
# from: what reconciliation reads to find clients that may be gone.
clients = Table(
    "durability_semaphore_clients",
    metadata,
    Column("semaphore", String(NAME_LENGTH), primary_key=True),
    Column("key", String(NAME_LENGTH), primary_key=True),
    Column("client_id", String(NAME_LENGTH), primary_key=True),
    Column("last_seen_at", Double, nullable=False),
    Index("ix_durability_semaphore_clients_seen", "semaphore", "last_seen_at"),
)

schema_version = Table(
    "durability_semaphore_schema",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("version", Integer, nullable=False),
)

# Upgrade steps: UPGRADES[n] takes a database from version n to n + 1.
UPGRADES: dict[int, tuple[str, ...]] = {
    # 2: leases record whether their client has reported them since issue; leases of
    # version 1 count as acknowledged, as that version treated every lease.
    1: ("ALTER TABLE durability_semaphore_leases"
        " ADD COLUMN acknowledged BOOLEAN NOT NULL DEFAULT TRUE",),
    # 3: the deadline index holds only keys with a deadline (see _DEADLINE_WHERE).
    2: ("DROP INDEX ix_durability_semaphore_keys_deadline",
        "CREATE INDEX ix_durability_semaphore_keys_deadline ON durability_semaphore_keys"
        " (semaphore, next_claim_deadline) WHERE next_claim_deadline IS NOT NULL"),
    # 4: leases record the round that issued them, which only a later report
    # acknowledges; 0 lets any report acknowledge those of version 3, as it did.
    3: ("ALTER TABLE durability_semaphore_leases"
        " ADD COLUMN issued_round BIGINT NOT NULL DEFAULT 0",),
}


def _lock_for_ddl(conn: Connection) -> None:
    # Two holders starting at once must not both create the tables; PostgreSQL
    # DDL is transactional, so an advisory lock held to commit serializes them.
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('durability_semaphore_schema'))"))


def _current_version(conn: Connection) -> int | None:
    if not conn.dialect.has_table(conn, schema_version.name):
        return None
    return conn.execute(select(schema_version.c.version).where(schema_version.c.id == 1)).scalar()


def _upgrade(conn: Connection, found: int | None) -> MigrateOutcome:
    if found is not None and found > SCHEMA_VERSION:
        raise ConfigurationError(
            f"database schema version {found} is newer than this library's {SCHEMA_VERSION}; "
            "upgrade durability-celery"
        )
    metadata.create_all(conn, checkfirst=True)
    version = SCHEMA_VERSION if found is None else found
    while version < SCHEMA_VERSION:
        for statement in UPGRADES[version]:
            conn.execute(text(statement))
        version += 1
    if found is None:
        conn.execute(insert(schema_version).values(id=1, version=SCHEMA_VERSION))
        return "created"
    if found != SCHEMA_VERSION:
        conn.execute(update(schema_version).where(schema_version.c.id == 1).values(version=version))
        return "upgraded"
    return "current"


def _drop(conn: Connection) -> MigrateOutcome:
    present = any(conn.dialect.has_table(conn, table.name) for table in metadata.sorted_tables)
    metadata.drop_all(conn, checkfirst=True)
    return "removed" if present else "absent"


def check_version(engine: Engine) -> int | None:
    """The database's schema version (None: no schema yet); an older one than this
    library's raises ConfigurationError, since rounds would fail on every message."""
    with engine.connect() as conn:
        found = _current_version(conn)
    if found is not None and found < SCHEMA_VERSION:
        raise ConfigurationError(
            f"database schema version {found} is older than this library's "
            f"{SCHEMA_VERSION}; run `durability-celery migrate` (or sem.migrate()) first"
        )
    return found


def migrate(engine: Engine, target: int | None = SCHEMA_VERSION) -> MigrateOutcome:
    """Create or upgrade the schema (idempotent); `target=None` removes it entirely.
    Returns what it did (see MigrateOutcome), so a caller can say so."""
    if target is not None and target != SCHEMA_VERSION:
        raise ConfigurationError(
            f"migrate target must be {SCHEMA_VERSION} (create or upgrade) or None (remove), "
            f"got {target!r}"
        )
    with engine.connect() as conn:
        # `durability_write` asks for BEGIN IMMEDIATE on SQLite (see store.sql).
        conn = conn.execution_options(durability_write=True)
        with conn.begin():
            _lock_for_ddl(conn)
            if target is None:
                return _drop(conn)
            return _upgrade(conn, _current_version(conn))
