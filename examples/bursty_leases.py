"""Leases for bursty short tasks.

A burst of 150 short tasks for one account. With grants alone, every batch of
admissions waits for an allocation round at the holder. With a lease, the
holder hands the worker a block of permits it draws from locally, one per
task, with no round trip. `Under(reserve=8)` keeps 8 of the account's 10
permits for leases (grants get the other 2), and grants plus leases still
never pass the limit. (`Strict()` gives leases only what grants leave, so in
a burst that keeps every permit busy it would hand out few leases.)

Run it:  python -m examples.bursty_leases
"""

from __future__ import annotations

import time

from celery import Celery

from durability_celery import AdmittedTask, Durability, DurabilitySemaphore, Leases, Under
from examples import _embedded

LIMIT = 10

app = Celery("examples.bursty_leases")
app.conf.update(_embedded.celery_settings())

accounts = DurabilitySemaphore(
    "accounts", database=_embedded.database_url(), limit=LIMIT,
    leases=Leases(provisioning=Under(reserve=8), permits_per_lease=32, ttl=600.0),
    round_wait=0.05, round_period=0.2,
)
durability = Durability(app, [accounts])


@app.task(base=AdmittedTask, semaphore="accounts", key="account_id")
def thumbnail(account_id: str, image: int) -> None:
    _embedded.record("start", account_id)
    time.sleep(0.01)
    _embedded.record("end", account_id)


def admitted_from() -> dict[str, int]:
    """How the worker got its permits: drawn from leases, claimed from grants, or passed
    on from a finished task of the same account."""
    replies = app.control.broadcast("durability_held", reply=True, timeout=2.0)
    totals = {"lease": 0, "grant": 0, "handoff": 0}
    for reply in replies:
        for answer in reply.values():
            for source, count in answer.get("admitted_from", {}).items():
                totals[source] += count
    return totals


def main() -> None:
    accounts.migrate()
    burst = 150
    with _embedded.workers("examples.bursty_leases", clients=1, concurrency=10):
        started = time.monotonic()
        for image in range(burst):
            thumbnail.delay("acct-1", image)
        _embedded.wait_for_ends(burst)
        elapsed = time.monotonic() - started
        sources = admitted_from()
    peak, finished = _embedded.peaks()
    rounds = accounts.state("acct-1").rounds
    print(f"{finished} tasks in {elapsed:.1f}s, peak {peak['acct-1']} running (limit {LIMIT})")
    print(f"permits drawn from leases: {sources['lease']}, claimed from grants: "
          f"{sources['grant']}, passed on by finished tasks: {sources['handoff']}, "
          f"allocation rounds at the holder: {rounds}")
    assert finished == burst and peak["acct-1"] <= LIMIT
    assert sources["lease"] > sources["grant"]


if __name__ == "__main__":
    main()
