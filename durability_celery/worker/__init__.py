# The client side inside Celery workers: `AdmittedTask` for producers and task
# authors, and `install`, which Durability calls to put the gate into workers.
from __future__ import annotations

from .install import install
from .task import AdmissionError, AdmittedTask

__all__ = ["AdmissionError", "AdmittedTask", "install"]
