# The do-it-yourself limit Celery users write today: a Redis counter per key,
# INCR on start; over the limit, DECR and retry later with a countdown; DECR in
# `finally` when the work ends. Kept faithful on purpose, flaws included, so the
# benchmarks compare against what people actually run:
# - a worker killed mid-task (SIGKILL, OOM, hard time limit) never runs the
#   `finally`: the counter leaks and the key's budget shrinks forever (no TTL;
#   adding one instead lets the counter expire under running tasks and exceed
#   the limit);
# - waiting is polling: every refused attempt is a republished message, a
#   countdown spent idle (utilization lost) and a trip to the back of the line
#   (no fairness, no order);
# - Celery's default max_retries is 3, so the common copy drops tasks under
#   contention; this one sets max_retries=None, as the careful copy does.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, Task

COUNTER_PREFIX = "diy:"


def define_diy_task(app: Celery, *, counter_url: str, countdown: float,
                    body: Callable[[str, float, float], None],
                    on_retry: Callable[[str], object]) -> Task:
    """Register `bench.diy(run, account, limit, work, published_at)` on `app`."""
    counter = redis.Redis.from_url(counter_url)

    @app.task(bind=True, name="bench.diy", max_retries=None,  # type: ignore[untyped-decorator]
              shared=False)
    def diy(self: Any, run: str, account: str, limit: int, work: float,
            published_at: float) -> None:
        key = COUNTER_PREFIX + account
        if counter.incr(key) > limit:
            counter.decr(key)
            on_retry(run)
            raise self.retry(countdown=countdown)
        try:
            body(run, work, published_at)
        finally:
            counter.decr(key)

    return diy
