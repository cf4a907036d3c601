# durability-celery: one shared concurrency budget per key across every Celery
# worker. This module is the public API; everything not listed in __all__ is
# private and may change without notice.
from __future__ import annotations

from .app import Durability, durability_for
from .blocking import BlockingClient
from .client import Permit, SemaphoreClient
from .core.config import Leases, Over, Strict, Under
from .core.usage import GroupUsage, Usage
from .errors import (
    CallerError,
    ConfigurationError,
    DurabilityError,
    HolderError,
    IllegalTransition,
    InfrastructureError,
    InvalidMessage,
    RequestTimeout,
)
from .semaphore import DurabilitySemaphore
from .settings import DurabilitySettings
from .store import metadata
from .transport import register as _register_transport
from .wire.reply import Blocked
from .worker import AdmissionError, AdmittedTask

__version__ = "0.1.0"

# Every process that imports the library can use `durability-filesystem://`.
_register_transport()

__all__ = [
    # the holder's budget
    "DurabilitySemaphore",
    "Leases",
    "Over",
    "Strict",
    "Under",
    "Usage",
    "GroupUsage",
    "Blocked",
    "metadata",
    # Celery integration
    "Durability",
    "DurabilitySettings",
    "AdmittedTask",
    "durability_for",
    # clients outside the gate
    "SemaphoreClient",
    "BlockingClient",
    "Permit",
    # errors
    "DurabilityError",
    "CallerError",
    "InvalidMessage",
    "IllegalTransition",
    "AdmissionError",
    "ConfigurationError",
    "InfrastructureError",
    "RequestTimeout",
    "HolderError",
    "__version__",
]
