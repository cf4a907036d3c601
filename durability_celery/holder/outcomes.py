# What a round batch's results tell the dispatcher: each round's responses (shed
# requests given their superseding request's answer), the alarms and blocked
# clients they name, and how a failure is logged. Rule: pure functions of the
# results, on any thread; the dispatcher alone acts on them.
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..errors import InfrastructureError, SchemaMissing
from ..wire.error import is_error
from ..wire.reply import (
    blocked_groups,
    claim_deadlines_of,
    is_over_limit,
    round_at_of,
    unacknowledged_expiries,
)
from ..wire.request import asked_groups, client_of
from .batching import KeyId, Round

logger = logging.getLogger("durability_celery.holder")


def shed_back(result: object, answers: list[int | None]) -> object:
    """A round's result for its requests shed included: each shed request gets the
    response of the one that superseded it (None in `answers`: it had its own)."""
    if not isinstance(result, list) or len(result) != answers.count(None):
        return result  # failed, or a wrong answer that responses_of reports
    own = iter(result)
    mine = [next(own) if a is None else None for a in answers]
    return [m if a is None else mine[a] for m, a in zip(mine, answers, strict=True)]


def responses_of(job: Round, result: object) -> list[dict[str, Any]] | None:
    """A round's responses, or None when it failed (None: with its whole batch, logged
    already) or answered the wrong number."""
    if result is None:
        return None
    if isinstance(result, Exception):
        log_failure("round", job.key_id, result)
        return None
    if not isinstance(result, list) or len(result) != len(job.requests):
        logger.error("durability holder: round for %s/%s gave a wrong answer: %r",
                     job.key_id[0], job.key_id[1], result)
        return None
    return result


def claim_deadlines(responses: Iterable[dict[str, Any]]) -> Iterable[float]:
    """Claim deadlines of the grants with unclaimed permits named in these responses,
    and the expiry of each unacknowledged lease (dropped then, see Lease.acknowledged)."""
    for response in responses:
        yield from claim_deadlines_of(response)
        yield from unacknowledged_expiries(response)


def first_round_at(responses: list[dict[str, Any]] | None) -> float | None:
    """The round's own timestamp, from any successful response."""
    for response in responses or ():
        at = round_at_of(response)
        if at is not None:
            return at
    return None


def blocked_by(job: Round, responses: list[dict[str, Any]] | None,
             ) -> dict[str, frozenset[str | None]] | None:
    """For each client the round answered, the groups whose demand it left blocked (all
    it asked for while the key is over its limit). None: the round failed."""
    if responses is None:
        return None
    blocked: dict[str, frozenset[str | None]] = {}
    for request, response in zip(job.requests, responses, strict=True):
        client = client_of(request.body)
        if client is None or is_error(response):
            continue
        groups = blocked_groups(response)
        if is_over_limit(response):
            groups |= asked_groups(request.body)
        blocked[client] = blocked.get(client, frozenset()) | groups
    return blocked


def log_failure(what: str, key_id: KeyId, exc: Exception) -> None:
    if isinstance(exc, SchemaMissing):
        logger.error("durability holder: %s for %s/%s failed: %s", what, key_id[0], key_id[1],
                     exc)
    elif isinstance(exc, InfrastructureError) or _is_database_error(exc):
        logger.error("durability holder: %s for %s/%s failed, database unavailable: %r",
                     what, key_id[0], key_id[1], exc)
    else:
        logger.error("durability holder: %s for %s/%s failed", what, key_id[0], key_id[1],
                     exc_info=exc)


def _is_database_error(exc: Exception) -> bool:
    from sqlalchemy.exc import SQLAlchemyError

    return isinstance(exc, SQLAlchemyError)
