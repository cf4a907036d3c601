# The SQL store: tables, migrations and one locked transaction per round.
# Rule: it holds no allocation policy; the pure core decides, the store persists.
from .engine import create_engine, prepare_engine, transaction
from .schema import (
    SCHEMA_VERSION,
    MigrateOutcome,
    check_version,
    clients,
    grants,
    keys,
    leases,
    metadata,
    migrate,
)
from .sql import all_keys, deadlines, load, prune_keys, read, save, silent_clients

__all__ = [
    # schema
    "SCHEMA_VERSION",
    "MigrateOutcome",
    "check_version",
    "clients",
    "grants",
    "keys",
    "leases",
    "metadata",
    "migrate",
    # engines and transactions
    "create_engine",
    "prepare_engine",
    "transaction",
    # state
    "load",
    "read",
    "save",
    # queries
    "all_keys",
    "deadlines",
    "silent_clients",
    # maintenance
    "prune_keys",
]
