# The jobs the holder's round threads run: a batch of one semaphore's rounds, a
# reclaim, a scan for deadlines. Rules: the only place the holder's SQL runs;
# each job returns the event that reports it to the dispatcher, whose thread
# alone acts on it (publishes replies, sets alarms).
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .batching import KeyId, Reclaim, Round
from .outcomes import log_failure, responses_of, shed_back
from .shedding import answered_by

logger = logging.getLogger("durability_celery.holder")


@dataclass(frozen=True)
class BatchDone:
    rounds: tuple[tuple[Round, list[dict[str, Any]] | None], ...]
    """Each round with its responses; None: that round failed, nothing of it committed."""
    shed: int = 0
    """Requests answered with a newer one's response (shedding.answered_by)."""


@dataclass(frozen=True)
class ReclaimDone:
    key_id: KeyId
    deadline: float | None
    failed: bool


@dataclass(frozen=True)
class ScanDone:
    deadlines: list[tuple[KeyId, float]]


def run_batch(semaphores: Mapping[str, Any], jobs: list[Round]) -> BatchDone:
    """The rounds of `jobs` (keys of one semaphore) in one transaction."""
    semaphore = jobs[0].key_id[0]
    answers = _shed(semaphore, jobs)
    try:
        batch = [(job.key_id[1], [r.body for r, a in zip(job.requests, mine, strict=True)
                                  if a is None])
                 for job, mine in zip(jobs, answers, strict=True)]
        results = semaphores[semaphore].run_rounds(batch)
        if len(results) != len(jobs):
            raise RuntimeError(f"run_rounds returned {len(results)} results "
                               f"for {len(jobs)} keys")
    except Exception as exc:  # the whole batch: nothing of it committed
        what = "round" if len(jobs) == 1 else f"round batch of {len(jobs)} keys"
        log_failure(what, jobs[0].key_id, exc)
        results = [None] * len(jobs)
    try:
        done = tuple((job, responses_of(job, shed_back(result, mine)))
                     for job, result, mine in zip(jobs, results, answers, strict=True))
    except Exception:  # a bug must not leave these keys busy and this thread counted
        logger.exception("durability holder: answering a round batch failed")
        done = tuple((job, None) for job in jobs)
    shed = sum(1 for mine in answers for a in mine if a is not None)
    return BatchDone(done, shed)


def _shed(semaphore: str, jobs: list[Round]) -> list[list[int | None]]:
    """Per round, which requests superseded ones are answered by (shedding.py)."""
    try:
        return [answered_by([r.body for r in job.requests], semaphore=semaphore,
                            key=job.key_id[1]) for job in jobs]
    except Exception:  # a bug here must not cost the batch: nothing is shed
        logger.exception("durability holder: shedding superseded requests failed")
        return [[None] * len(job.requests) for job in jobs]


def run_reclaim(semaphores: Mapping[str, Any], job: Reclaim) -> ReclaimDone:
    semaphore, key = job.key_id
    try:
        deadline = semaphores[semaphore].reclaim(key)
    except Exception as exc:
        log_failure("reclaim", job.key_id, exc)
        return ReclaimDone(job.key_id, None, failed=True)
    return ReclaimDone(job.key_id, deadline, failed=False)


def scan(semaphores: Mapping[str, Any], serves: Callable[[str, str], bool]) -> ScanDone:
    """Every pending deadline of the keys this holder serves, not only the due ones:
    a restarted holder must follow deadlines set by the one before it."""
    found: list[tuple[KeyId, float]] = []
    for name, semaphore in semaphores.items():
        try:
            for key, deadline in semaphore.deadlines():
                if serves(name, key):
                    found.append(((name, key), float(deadline)))
        except Exception as exc:
            log_failure("deadline scan", (name, "*"), exc)
    return ScanDone(found)
