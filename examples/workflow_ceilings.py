"""Per-workflow ceilings under an account cap.

Account `acme` may run 4 tasks at once in all. Its nightly export workflow
may use at most 1 of those 4, so interactive work is never starved by a bulk
job; the other workflows share the rest. A group is any string you choose:
here the `workflow_id` argument.

Run it:  python -m examples.workflow_ceilings
"""

from __future__ import annotations

import time

from celery import Celery

from durability_celery import AdmittedTask, Durability, DurabilitySemaphore
from examples import _embedded

ACCOUNT_LIMIT = 4
WORKFLOW_LIMITS = {"nightly-export": 1}

app = Celery("examples.workflow_ceilings")
app.conf.update(_embedded.celery_settings())


def workflow_limit(account_id: str, workflow_id: str) -> int | None:
    """None: this workflow has no ceiling of its own, only the account's."""
    return WORKFLOW_LIMITS.get(workflow_id)


accounts = DurabilitySemaphore(
    "accounts", database=_embedded.database_url(), limit=ACCOUNT_LIMIT,
    group_limit=workflow_limit, round_wait=0.05, round_period=0.2,
)
durability = Durability(app, [accounts])


@app.task(base=AdmittedTask, semaphore="accounts", key="account_id", group="workflow_id")
def run_step(account_id: str, workflow_id: str, step: int) -> None:
    _embedded.record("start", account_id, workflow_id)
    time.sleep(0.3)
    _embedded.record("end", account_id, workflow_id)


def main() -> None:
    accounts.migrate()
    steps = [("nightly-export", n) for n in range(6)] + [("checkout", n) for n in range(10)]
    with _embedded.workers("examples.workflow_ceilings", clients=2, concurrency=6):
        for workflow, n in steps:
            run_step.delay("acme", workflow, n)
        _embedded.wait_for_ends(len(steps))
    by_account, finished = _embedded.peaks()
    by_workflow, _ = _embedded.peaks(by_group=True)
    print(f"acme: peak {by_account['acme']} running at once, account cap {ACCOUNT_LIMIT}")
    for (_, workflow), top in sorted(by_workflow.items()):
        ceiling = WORKFLOW_LIMITS.get(workflow, ACCOUNT_LIMIT)
        print(f"  workflow {workflow}: peak {top}, ceiling {ceiling}")
        assert top <= ceiling
    assert finished == len(steps) and by_account["acme"] <= ACCOUNT_LIMIT
    print(f"all {finished} steps ran within the account cap and the workflow ceilings")


if __name__ == "__main__":
    main()
