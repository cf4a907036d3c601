"""A producer outside Celery asking for permits.

Code that is not a Celery task (a web request handler, a cron script) can
take part in the same budget: `BlockingClient` asks the holder for a permit,
and releasing it gives the capacity back to the Celery workers and to every
other client. Here four threads each make three calls for one account whose
limit is 2.

Run it:  python -m examples.producer_outside_celery
"""

from __future__ import annotations

import threading
import time

from celery import Celery

from durability_celery import BlockingClient, Durability, DurabilitySemaphore
from examples import _embedded

LIMIT = 2

app = Celery("examples.producer_outside_celery")
app.conf.update(_embedded.celery_settings())
accounts = DurabilitySemaphore("accounts", database=_embedded.database_url(), limit=LIMIT,
                               round_wait=0.05, round_period=0.2)
durability = Durability(app, [accounts])


def call_api(worker: int) -> None:
    # One client per thread: a BlockingClient is used by one thread at a time.
    client = BlockingClient(durability, "accounts", timeout=30.0)
    try:
        for _ in range(3):
            with client.permit("acct-9", timeout=60.0):
                _embedded.record("start", "acct-9")
                time.sleep(0.2)  # the call that must not run more than LIMIT at once
                _embedded.record("end", "acct-9")
    finally:
        client.close()


def main() -> None:
    accounts.migrate()
    with _embedded.workers("examples.producer_outside_celery", holder_only=True):
        threads = [threading.Thread(target=call_api, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    peak, finished = _embedded.peaks()
    print(f"{finished} calls from 4 threads, peak {peak['acct-9']} at once (limit {LIMIT})")
    assert finished == 12 and peak["acct-9"] <= LIMIT
    print("usage after release:", accounts.usage("acct-9").in_use, "permits in use")


if __name__ == "__main__":
    main()
