# The client side of the semaphore: SemaphoreClient keeps one worker's client
# queue and its copies of grants and leases, transport-independent and sans-IO.
from __future__ import annotations

from .client import Permit, SemaphoreClient

__all__ = ["Permit", "SemaphoreClient"]
