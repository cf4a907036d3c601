# Shedding superseded requests (holder/shedding.py): an older request of a client
# is answered with its newest one's response only when the newest covers it, and a
# round over the requests kept ends exactly as one over them all: the same state,
# the newest request's counts, the same answer.
from __future__ import annotations

import itertools
from typing import Any

from durability_celery.core.config import RoundConfig
from durability_celery.core.round import KeyState, run_round
from durability_celery.holder.shedding import answered_by

SEM, KEY = "s", "k"


def message(client: str, *, grants: tuple[tuple[str, int, int], ...] = (),
            leases: tuple[tuple[str, int, int, bool], ...] = (),
            groups: tuple[str | None, ...] = (None,)) -> dict[str, Any]:
    return {"type": "request", "v": 1, "semaphore": SEM, "key": KEY, "client_id": client,
            "demand": [{"group": g, "count": 1, "oldest_at": 1.0} for g in groups],
            "grants": [{"grant_id": i, "claimed": c, "released": r} for i, c, r in grants],
            "leases": [{"lease_id": i, "drawn": d, "released": r, "stopped": s}
                       for i, d, r, s in leases]}


def shed(*bodies: dict[str, Any]) -> list[int | None]:
    return answered_by(list(bodies), semaphore=SEM, key=KEY)


def test_an_older_request_the_newest_covers_is_shed() -> None:
    older = message("c1", grants=(("g1", 1, 0),), leases=(("l1", 2, 1, False),))
    newer = message("c1", grants=(("g1", 2, 1), ("g2", 0, 0)), leases=(("l1", 2, 2, True),),
                    groups=(None, "x"))
    assert shed(older, message("c2"), newer) == [2, None, None]


def test_the_newest_of_three_answers_both_older_ones() -> None:
    assert shed(message("c1"), message("c1"), message("c1")) == [2, 2, None]


def test_an_older_request_is_kept_when_it_has_something_the_newest_lacks() -> None:
    newest = message("c1", grants=(("g1", 2, 1),), leases=(("l1", 2, 1, False),))
    for older in (
        message("c1", grants=(("g1", 2, 2),), leases=(("l1", 2, 1, False),)),  # released
        message("c1", grants=(("g1", 3, 1),), leases=(("l1", 2, 1, False),)),  # claimed
        message("c1", grants=(("g1", 2, 1), ("g9", 1, 0)), leases=(("l1", 2, 1, False),)),
        message("c1", grants=(("g1", 2, 1),), leases=(("l1", 2, 1, True),)),  # stopped
        message("c1", grants=(("g1", 2, 1),), leases=(("l1", 3, 1, False),)),  # drawn
        message("c1", grants=(("g1", 2, 1),), leases=(("l1", 2, 1, False),),
                groups=(None, "x")),  # demand for a group the newest does not ask for
    ):
        assert shed(older, newest) == [None, None], older


def test_nothing_is_shed_for_an_invalid_newest_or_across_clients() -> None:
    broken = {**message("c1"), "v": 99}
    assert shed(message("c1"), broken) == [None, None]
    assert shed({**message("c1"), "v": 99}, message("c1")) == [None, None]
    assert shed(message("c1"), message("c2")) == [None, None]


def _round(state: KeyState, messages: list[dict[str, Any]]) -> tuple[KeyState, list[Any]]:
    ids = (f"id{n}" for n in itertools.count())
    config = RoundConfig(semaphore=SEM, grant_timeout=10.0, round_wait=1.0, round_period=2.0)

    class Limits:
        def limit(self, key: str) -> int:
            return 3

        def group_limit(self, key: str, group: str) -> int | None:
            return None

        def can_grant(self, key: str, client_id: str, group: str | None) -> bool:
            return True

    result = run_round(state, messages, config=config, limits=Limits(), now=100.0,
                       new_id=lambda: next(ids))
    return result.state, list(result.responses)


def test_a_round_over_the_kept_requests_ends_as_one_over_all_of_them() -> None:
    # c1 holds a grant of 3; its older request claimed 1, its newest claims 3 and
    # releases 2 (and asks again); c2 asks meanwhile. The newest's counts are kept.
    state, first = _round(KeyState(semaphore=SEM, key=KEY),
                          [{**message("c1"), "demand": [
                              {"group": None, "count": 3, "oldest_at": 1.0}]}])
    grant = first[0]["grants"][0]["grant_id"]
    older = message("c1", grants=((grant, 1, 0),))
    newest = message("c1", grants=((grant, 3, 2),))
    bodies = [older, message("c2"), newest]
    answers = shed(*bodies)
    assert answers == [2, None, None]
    all_state, all_responses = _round(state, bodies)
    kept = [b for b, a in zip(bodies, answers, strict=True) if a is None]
    kept_state, kept_responses = _round(state, kept)
    assert kept_state == all_state
    assert kept_responses == all_responses[1:]
    assert [(g["claimed"], g["released"]) for g in kept_responses[1]["grants"]
            if g["grant_id"] == grant] == [(3, 2)]
