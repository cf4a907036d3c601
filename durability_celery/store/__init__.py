# The stores: SQL (tables, migrations and one locked transaction per round) and,
# for tests and embedding, memory.py (each key's state in a dict); contract.py is
# the round API both give.
# Rule: they hold no allocation policy; the pure core decides, the store persists.
from .cache import StateCache
from .contract import Store
from .engine import create_engine, prepare_engine, run_transaction, transaction
from .memory import MemorySemaphore
from .queries import all_keys, deadlines, prune_keys, silent_clients
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
from .sql import forget_unused_keys, load, load_many, read
from .writes import save, save_many

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
    "run_transaction",
    # state
    "load",
    "read",
    "save",
    "load_many",
    "StateCache",
    "forget_unused_keys",
    "save_many",
    # queries
    "all_keys",
    "deadlines",
    "silent_clients",
    # maintenance
    "prune_keys",
    # the contract, and the store in memory
    "Store",
    "MemorySemaphore",
]
