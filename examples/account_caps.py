"""Account-level caps for a task that calls a partner API.

Every account may run at most its plan's number of `sync_invoices` calls at
once, across all workers: free accounts 2, paid accounts 5. Nothing is
retried or re-queued: tasks over the cap wait in the worker, oldest first.

Run it (no services needed: an embedded broker and SQLite in a temp folder):
    python -m examples.account_caps
In production the same module is what your workers load:
    celery -A examples.account_caps worker --durability-holder   # one or two holders
    celery -A examples.account_caps worker                       # any number of workers
"""

from __future__ import annotations

import time

from celery import Celery

from durability_celery import AdmittedTask, Durability, DurabilitySemaphore
from examples import _embedded

PLAN_LIMITS = {"free": 2, "paid": 5}

app = Celery("examples.account_caps")  # the module name: tasks get the same names everywhere
app.conf.update(_embedded.celery_settings())


def account_limit(account_id: str) -> int:
    """Resolved live, once per allocation round: change a plan and the cap follows."""
    return PLAN_LIMITS["free" if account_id.startswith("free-") else "paid"]


accounts = DurabilitySemaphore(
    "accounts", database=_embedded.database_url(), limit=account_limit,
    round_wait=0.05, round_period=0.2,  # short rounds: this example is about caps, not batching
)
durability = Durability(app, [accounts])


@app.task(base=AdmittedTask, semaphore="accounts", key="account_id")
def sync_invoices(account_id: str, page: int) -> None:
    _embedded.record("start", account_id)
    time.sleep(0.3)  # the partner API call
    _embedded.record("end", account_id)


def main() -> None:
    accounts.migrate()
    with _embedded.workers("examples.account_caps", clients=2, concurrency=8):
        calls = [(account, page) for account in ("free-1", "paid-7") for page in range(12)]
        for account, page in calls:
            sync_invoices.delay(account, page)
        _embedded.wait_for_ends(len(calls))
    peak, finished = _embedded.peaks()
    for account, top in sorted(peak.items()):
        print(f"{account}: peak {top} running at once, cap {account_limit(account)}")
    assert finished == len(calls)
    assert all(top <= account_limit(account) for account, top in peak.items())
    print(f"all {finished} calls ran, and no account went over its cap")


if __name__ == "__main__":
    main()
