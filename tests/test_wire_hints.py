# The wire's hints (the end of wire/request.py, wire/reply.py and wire/error.py): the
# holder reads raw messages and its own replies through them, so they read what a
# well-formed message says, and a field missing or of the wrong kind as nothing,
# never raising.
from __future__ import annotations

from typing import Any

import pytest

from durability_celery.wire.error import error_message_of, error_reply, is_error
from durability_celery.wire.reply import (
    ask_no_sooner,
    blocked_entry,
    blocked_groups,
    claim_deadlines_of,
    is_over_limit,
    next_request_at_of,
    reply_body,
    round_at_of,
    unacknowledged_expiries,
)
from durability_celery.wire.request import address_of

JUNK: list[Any] = [None, True, "x", 1, [], {}, [None, 1, "x"], {"status": "active"}]


def built_reply() -> dict[str, Any]:
    grant = {"grant_id": "g", "group": None, "permits": 2, "claimed": 1, "released": 0,
             "claim_deadline": 12.5, "status": "active"}
    return reply_body(
        semaphore="s", key="k", round_at=10.0, next_request_at=11.0, contended=True,
        over_limit=True,
        grants=[grant, grant | {"claimed": 2, "claim_deadline": 13.0},
                grant | {"status": "expired", "claim_deadline": 14.0}],
        leases=[{"lease_id": "a", "expires_at": 20.0, "acknowledged": False},
                {"lease_id": "b", "expires_at": 21.0, "acknowledged": True}],
        blocked=[blocked_entry("g1", "limit", 3)],
    )


def test_a_built_reply_reads_as_it_was_built() -> None:
    reply = built_reply()
    assert (round_at_of(reply), next_request_at_of(reply)) == (10.0, 11.0)
    assert list(claim_deadlines_of(reply)) == [12.5]  # not the claimed, nor the expired
    assert list(unacknowledged_expiries(reply)) == [20.0]
    assert blocked_groups(reply) == frozenset({"g1"})
    assert is_over_limit(reply) and not is_error(reply)
    ask_no_sooner(reply, 10.5)  # never earlier than it told
    assert reply["next_request_at"] == 11.0
    ask_no_sooner(reply, 15.0)
    assert reply["next_request_at"] == 15.0


def test_an_error_reply_reads_as_one_and_tells_no_time() -> None:
    error = error_reply("unavailable", "ask again later")
    assert is_error(error) and error_message_of(error) == "ask again later"
    assert round_at_of(error) is None
    ask_no_sooner(error, 15.0)
    assert "next_request_at" not in error


@pytest.mark.parametrize("junk", JUNK)
def test_a_field_of_the_wrong_kind_reads_as_nothing(junk: Any) -> None:
    fields = ("round_at", "next_request_at", "grants", "leases", "blocked", "error")
    raw = dict.fromkeys(fields, junk) | {"over_limit": False}
    assert list(claim_deadlines_of(raw)) == [] and list(unacknowledged_expiries(raw)) == []
    assert blocked_groups(raw) == frozenset()
    assert error_message_of(raw) is None
    if isinstance(junk, int) and not isinstance(junk, bool):
        return  # a number is a fine time
    assert round_at_of(raw) is None and next_request_at_of(raw) is None
    raw = {"grants": [{"status": "active", "permits": junk, "claimed": junk,
                       "claim_deadline": junk}],
           "leases": [{"acknowledged": False, "expires_at": junk}]}
    assert list(claim_deadlines_of(raw)) == [] and list(unacknowledged_expiries(raw)) == []


def test_a_raw_request_names_its_address_only_as_two_strings() -> None:
    assert address_of({"semaphore": "s", "key": "k", "type": "request"}) == ("s", "k")
    for junk in (j for j in JUNK if not isinstance(j, str)):
        assert address_of({"semaphore": junk, "key": "k"}) is None
        assert address_of({"semaphore": "s", "key": junk}) is None
    assert address_of({}) is None
