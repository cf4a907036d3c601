# The message headers an admitted task carries: stamped at publish (task.py,
# install.py) and read by the gate (gate/). No Celery import: the gate's policy
# reads them.
from __future__ import annotations

HEADER_SEMAPHORE = "durability_semaphore"
HEADER_KEY = "durability_key"
HEADER_GROUP = "durability_group"
HEADER_ENQUEUED_AT = "durability_enqueued_at"
