# BlockingClient's own checks, where no holder is needed: bad timeouts are refused, and
# an unreachable broker ends a wait at its deadline, saying why.
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from durability_celery import BlockingClient, Durability, DurabilitySemaphore
from durability_celery.errors import CallerError, RequestTimeout


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("blocking_test", broker="redis://127.0.0.1:1/0", set_as_current=False)
    semaphore = DurabilitySemaphore("jobs", database=f"sqlite:///{tmp_path / 'd.db'}", limit=1)
    Durability(app, [semaphore])
    yield app
    semaphore.close()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "3", True])
def test_a_bad_timeout_is_refused(app: Celery, timeout: Any) -> None:
    with pytest.raises(CallerError, match=r"^timeout must be a number of seconds > 0"):
        BlockingClient(app, "jobs", timeout=timeout)
    client = BlockingClient(app, "jobs", timeout=1.0)
    with pytest.raises(CallerError, match=r"^timeout must be a number of seconds > 0"):
        client.acquire("k", timeout=timeout)
    assert client.client.held() == {}  # nothing was queued


def test_an_unreachable_broker_ends_the_wait_at_its_deadline_naming_the_broker(
        app: Celery) -> None:
    client = BlockingClient(app, "jobs", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"within 1\.5s \(last reason: .*broker: "
                                             r"OperationalError") as raised:
        client.acquire("k", timeout=1.5)
    # The connection's own retries stay short: the deadline, not kombu, ends the wait.
    assert time.monotonic() - started < 3.0, raised.value
    assert client.client.held() == {}
