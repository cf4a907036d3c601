# Counting the pool slots taken by work the gate did not admit, while pool
# threads change Celery's set of active requests. Rule under test: the count
# never raises, whatever the threads do meanwhile; iterating the WeakSet itself
# raised "Set changed size during iteration" about 2,000 times a second here,
# and once killed a threads worker's consumer under load.
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest
from celery.worker import state as worker_state

from durability_celery.worker.step import unadmitted_active

pytestmark = pytest.mark.timeout(30)


class Active:
    """A request as the count sees it: admitted ones carry a release hook."""

    def __init__(self, admitted: bool) -> None:
        self._durability_release = (lambda item: None) if admitted else None


@pytest.fixture
def fast_switching() -> Iterator[None]:
    # Switch threads every microsecond, so a change lands inside a count often.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_the_count_sees_only_requests_the_gate_did_not_admit() -> None:
    requests = [Active(admitted=n % 2 == 0) for n in range(6)]
    for request in requests:
        worker_state.active_requests.add(request)
    try:
        assert unadmitted_active() == 3
    finally:
        for request in requests:
            worker_state.active_requests.discard(request)
    assert unadmitted_active() == 0


def test_the_count_survives_pool_threads_changing_the_set(fast_switching: None) -> None:
    requests = [Active(admitted=False) for _ in range(32)]
    stop = threading.Event()

    def pool_thread() -> None:
        while not stop.is_set():
            for request in requests:
                worker_state.active_requests.add(request)
            for request in requests:
                worker_state.active_requests.discard(request)

    thread = threading.Thread(target=pool_thread)
    thread.start()
    counts = set()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            counts.add(unadmitted_active())
    finally:
        stop.set()
        thread.join()
    assert counts <= set(range(33))
    assert len(counts) > 2, "the thread changed the set while it was counted"
