# The lease rules of the spec on every backend: provisioning modes, equal
# shares, eligibility, contention, stopping and settlement, ttl retirement,
# unknown and unacknowledged leases, and retirement when limits or eligibility
# are lowered.
from __future__ import annotations

from typing import Any

import pytest
from core_harness import KEY, Limits, blocked, granted, leased, request, sync

from durability_celery.core.config import Leases, Over, Strict, Under

T0 = 1_000.0


def lease_ids(reply: dict[str, Any]) -> list[str]:
    return [le["lease_id"] for le in reply["leases"] if le["status"] == "active"]


def ask(client: str, count: int, at: float = 1.0, group: str | None = None, **kw: Any) -> Any:
    return request(client, [(group, count, at)], supports_leases=True, **kw)


def test_strict_grants_first_then_leases_from_what_is_left(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=64))
    (reply,) = sem.run_round(KEY, [ask("a", 4)], now=T0)
    assert granted(reply) == 4 and leased(reply) == 6
    usage = sem.usage(KEY, now=T0)
    assert usage.outstanding + usage.lease_footprint == 10


def test_lease_budget_shared_equally_with_the_remainder_to_the_oldest(
        make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(11), leases=Leases(Strict(), permits_per_lease=64))
    replies = sem.run_round(KEY, [ask("a", 1, at=3.0), ask("b", 1, at=1.0), ask("c", 1, at=2.0)],
                            now=T0)
    assert [granted(r) for r in replies] == [1, 1, 1]
    # 8 left, 3 candidates: 2 each, and the 2 left over to the two oldest (b, then c).
    assert [leased(r) for r in replies] == [2, 3, 3]
    assert sem.usage(KEY, now=T0).lease_footprint == 8


def test_over_issues_its_whole_extra_to_two_clients(make_semaphore: Any) -> None:
    # Both ask for more than the limit: grants take it, the extra 5 goes to leases.
    sem = make_semaphore(Limits(4), leases=Leases(Over(extra=5), permits_per_lease=64))
    replies = sem.run_round(KEY, [ask("a", 50, at=2.0), ask("b", 50, at=1.0)], now=T0)
    assert sum(granted(r) for r in replies) == 4
    assert [leased(r) for r in replies] == [2, 3]


def test_a_client_with_no_free_slot_gets_no_lease_while_another_has_one(
        make_semaphore: Any) -> None:
    # Its undrawn permits would idle there; its demand still gets grants. Alone, it
    # gets its lease for its next free slot.
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=64))
    full_message, free_message = ask("a", 2, at=1.0), ask("b", 1, at=2.0)
    full_message["demand"][0]["ready"] = 0
    full, free = sem.run_round(KEY, [full_message, free_message], now=T0)
    assert (granted(full), granted(free)) == (2, 1)
    assert (leased(full), leased(free)) == (0, 7)
    alone_message = ask("c", 1, at=1.0, key="other")
    alone_message["demand"][0]["ready"] = 0
    (alone,) = sem.run_round("other", [alone_message], now=T0)
    assert (granted(alone), leased(alone)) == (1, 9)


def test_permits_per_lease_caps_a_share(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(100), leases=Leases(Strict(), permits_per_lease=5))
    (reply,) = sem.run_round(KEY, [ask("a", 1)], now=T0)
    assert leased(reply) == 5


def test_fewer_permits_than_candidates_oldest_get_one(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(2), leases=Leases(Strict()))
    # Zero-count demand is not a candidate, so put demand that grants cannot
    # serve: limit 2 is used up by nothing; three candidates want leases only.
    replies = sem.run_round(KEY, [ask("a", 1, at=3.0), ask("b", 1, at=1.0), ask("c", 1, at=2.0)],
                            now=T0)
    assert [granted(r) for r in replies] == [0, 1, 1]
    assert sum(leased(r) for r in replies) == 0
    sem2 = make_semaphore(Limits(5), leases=Leases(Strict()))
    replies = sem2.run_round(KEY, [ask(c, 1, at=float(i)) for i, c in enumerate("abcd")],
                             now=T0)
    assert [leased(r) for r in replies] == [1, 0, 0, 0]


def test_under_keeps_a_reserve_for_leases(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Under(reserve=4)))
    (grants_only, wants_lease) = sem.run_round(KEY, [
        request("a", [(None, 10, 1.0)], supports_leases=False), ask("b", 1, at=2.0)
    ], now=T0)
    assert granted(grants_only) == 6 and blocked(grants_only) == {None: ("limit", 4)}
    assert granted(wants_lease) == 0 and leased(wants_lease) == 4
    usage = sem.usage(KEY, now=T0)
    assert usage.outstanding + usage.lease_footprint == 10


def test_under_reserve_never_takes_the_last_permit(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(3), leases=Leases(Under(reserve=5)))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 3, 1.0)])], now=T0)
    assert granted(reply) == 1


@pytest.mark.parametrize("over", [Over(extra=5), Over(ratio=0.5)], ids=["extra", "ratio"])
def test_over_leases_come_from_above_the_limit(make_semaphore: Any, over: Over) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(over))
    (reply,) = sem.run_round(KEY, [ask("a", 10)], now=T0)
    assert granted(reply) == 10 and leased(reply) == 5
    usage = sem.usage(KEY, now=T0)
    assert usage.outstanding == 10 and usage.lease_footprint == 5


def test_over_grants_stop_at_limit_plus_extra_when_leases_hold_more_than_the_extra(
        make_semaphore: Any) -> None:
    # A lease a report brings back is charged whatever the limit, so leases can hold
    # more than the extra; grants then get only what keeps the total at limit + extra.
    sem = make_semaphore(Limits(6), leases=Leases(Over(extra=3), permits_per_lease=3))
    (first,) = sem.run_round(KEY, [ask("a", 3)], now=T0)
    assert (granted(first), leased(first)) == (3, 3)
    sem.run_round(KEY, [sync("a", leases=[("unknown", 2, 0, False)])], now=T0 + 1)
    assert sem.usage(KEY, now=T0 + 1).lease_footprint == 5
    (second,) = sem.run_round(KEY, [ask("b", 5)], now=T0 + 2)
    assert granted(second) == 1
    assert sem.usage(KEY, now=T0 + 2).in_use == 9


def test_lease_eligibility(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(50, groups={"capped": 10}), leases=Leases(Strict()))
    no_support, capped, holder = sem.run_round(KEY, [
        request("a", [(None, 1, 1.0)], supports_leases=False),
        ask("b", 1, group="capped"),
        ask("c", 1),
    ], now=T0)
    assert leased(no_support) == 0 and leased(capped) == 0 and leased(holder) > 0
    # c still holds undrawn lease permits for its group: no second lease.
    (again,) = sem.run_round(KEY, [ask("c", 1)], now=T0 + 2)
    assert len(lease_ids(again)) == 1


def test_within_group_limit_leases_respect_the_ceiling(make_semaphore: Any) -> None:
    leases = Leases(Strict(), limited_groups="within_group_limit")
    sem = make_semaphore(Limits(50, groups={"w": 4}), leases=leases)
    (reply,) = sem.run_round(KEY, [ask("a", 1, group="w")], now=T0)
    assert granted(reply) == 1 and leased(reply) == 3


def test_stopped_lease_counts_drawn_until_released_then_settles(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Strict()))
    (reply,) = sem.run_round(KEY, [ask("a", 0 + 1)], now=T0)
    (lid,) = lease_ids(reply)
    (r1,) = sem.run_round(KEY, [sync("a", leases=[(lid, 3, 1, True)])], now=T0 + 1)
    assert r1["leases"][0]["status"] == "retired"
    assert sem.usage(KEY, now=T0 + 1).lease_footprint == 2
    (r2,) = sem.run_round(KEY, [sync("a", leases=[(lid, 3, 3, True)])], now=T0 + 2)
    assert [le["status"] for le in r2["leases"]] == ["settled"]
    assert sem.usage(KEY, now=T0 + 2).lease_footprint == 0
    # A repeated final report of a settled lease frees nothing more.
    (r3,) = sem.run_round(KEY, [sync("a", leases=[(lid, 3, 3, True)])], now=T0 + 3)
    assert r3["leases"][0]["status"] == "settled"


def test_unreported_lease_retires_after_ttl_and_stays_counted(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=8, ttl=60.0))
    (reply,) = sem.run_round(KEY, [ask("a", 1)], now=T0)
    (lid,) = lease_ids(reply)
    sem.run_round(KEY, [sync("a", leases=[(lid, 2, 0, False)])], now=T0 + 30)  # heartbeat
    assert sem.usage(KEY, now=T0 + 89).lease_footprint == 8
    (other,) = sem.run_round(KEY, [request("b", [(None, 10, 5.0)])], now=T0 + 90)
    assert granted(other) == 2  # round 1's unclaimed grant was reclaimed; the lease still counts
    assert sem.usage(KEY, now=T0 + 90).lease_footprint == 8  # retired, unconfirmed: in full
    (late,) = sem.run_round(KEY, [sync("a", leases=[(lid, 5, 1, True)])], now=T0 + 91)
    assert late["leases"][0]["status"] == "retired"
    assert sem.usage(KEY, now=T0 + 91).lease_footprint == 4


def test_contended_reply_when_demand_is_left(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(4), leases=Leases(Strict()))
    (a,) = sem.run_round(KEY, [ask("a", 1)], now=T0)
    assert not a["contended"] and leased(a) == 3
    (b,) = sem.run_round(KEY, [ask("b", 2)], now=T0 + 2)
    assert b["contended"] and blocked(b) == {None: ("limit", 2)}


def test_report_for_unknown_lease_is_retired_and_charged_until_settled(
    make_semaphore: Any,
) -> None:
    sem = make_semaphore(Limits(4), leases=Leases(Strict()))
    stray, other = sem.run_round(KEY, [
        sync("a", leases=[("never-issued", 3, 0, False)]),
        request("b", [(None, 4, 1.0)]),
    ], now=T0)
    assert stray["leases"][0]["status"] == "retired"
    assert stray["leases"][0]["acknowledged"] is False
    assert granted(other) == 1
    # Its client reports it again (it runs work on it): acknowledged, it is still
    # counted in later rounds that do not carry its report.
    (again,) = sem.run_round(KEY, [sync("a", leases=[("never-issued", 3, 0, False)])],
                             now=T0 + 5)
    assert again["leases"][0]["acknowledged"] is True
    (later,) = sem.run_round(KEY, [request("c", [(None, 4, 1.0)])], now=T0 + 20)
    assert granted(later) == 1 and sem.usage(KEY, now=T0 + 20).lease_footprint == 3
    (part,) = sem.run_round(KEY, [sync("a", leases=[("never-issued", 3, 2, True)])], now=T0 + 21)
    assert part["leases"][0]["status"] == "retired"
    assert sem.usage(KEY, now=T0 + 21).lease_footprint == 1
    (done,) = sem.run_round(KEY, [sync("a", leases=[("never-issued", 3, 3, True)])], now=T0 + 22)
    assert done["leases"][0]["status"] == "settled"
    assert sem.usage(KEY, now=T0 + 22).lease_footprint == 0
    # A report of a lease the holder never knew with nothing in use charges nothing.
    (idle,) = sem.run_round(KEY, [sync("a", leases=[("other", 2, 2, True)])], now=T0 + 23)
    assert idle["leases"][0]["status"] == "settled"


def test_a_late_claims_lease_counts_against_its_groups_ceiling(make_semaphore: Any) -> None:
    # A grant of g1 (ceiling 1) is reclaimed before its claim was heard; its client
    # reports the claim as a late lease naming the grant's group. Charged to g1, it
    # holds g1's one slot until released, as the claim it stands for would have.
    sem = make_semaphore(Limits(4, groups={"g1": 1}), grant_timeout=5.0)
    (first,) = sem.run_round(KEY, [request("a", [("g1", 1, 1.0)])], now=T0)
    gid = first["grants"][0]["grant_id"]
    assert sem.reclaim(KEY, now=T0 + 5) is None
    (other,) = sem.run_round(KEY, [request("b", [("g1", 1, 2.0)])], now=T0 + 6)
    assert granted(other) == 1  # the reclaimed permit went to b

    def late_report(released: int) -> dict[str, Any]:
        message = sync("a", grants=[(gid, 1, 0)], leases=[("late:" + gid, 1, released, True)])
        message["leases"][0]["group"] = "g1"
        return message

    (late,) = sem.run_round(KEY, [late_report(0)], now=T0 + 7)
    assert [(le["status"], le["group"]) for le in late["leases"]] == [("retired", "g1")]
    assert late["over_limit"]  # g1 runs two tasks under a ceiling of 1: the holder says so
    (g1,) = sem.usage(KEY, now=T0 + 7).groups
    assert (g1.group, g1.outstanding, g1.lease_footprint) == ("g1", 1, 1)
    # b's task ends; the late one still runs, so g1 has no room for c.
    gid_b = other["grants"][0]["grant_id"]
    _, c = sem.run_round(KEY, [sync("b", grants=[(gid_b, 1, 1)]),
                               request("c", [("g1", 1, 3.0)])], now=T0 + 8)
    assert granted(c) == 0 and blocked(c) == {"g1": ("group_limit", 1)}
    # The late task ends: its lease settles and g1's slot is free again.
    (done,) = sem.run_round(KEY, [late_report(1)], now=T0 + 9)
    assert [le["status"] for le in done["leases"]] == ["settled"]
    (again,) = sem.run_round(KEY, [request("c", [("g1", 1, 3.0)])], now=T0 + 10)
    assert granted(again) == 1


def test_a_lease_its_client_never_reports_is_dropped_at_the_grant_timeout(
    make_semaphore: Any,
) -> None:
    # The reply that carried it may be lost, or answer a stale copy of a message:
    # nothing says its client knows of it, so it counts only as long as an
    # unclaimed grant would (grant_timeout 10 s here), not until ttl and beyond.
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=4, ttl=60.0))
    (reply,) = sem.run_round(KEY, [ask("a", 4)], now=T0)
    (view,) = reply["leases"]
    assert (view["acknowledged"], view["expires_at"]) == (False, T0 + 10)
    assert sem.reclaim(KEY, now=T0 + 9.9) == T0 + 10  # the holder's alarm waits for it
    assert sem.usage(KEY, now=T0 + 9.9).lease_footprint == 4
    assert sem.reclaim(KEY, now=T0 + 10) is None
    assert sem.usage(KEY, now=T0 + 10).leases == 0
    # Reported once, a lease is acknowledged and lives until ttl as the spec says.
    (r1,) = sem.run_round(KEY, [ask("b", 4)], now=T0 + 20)
    (lid,) = lease_ids(r1)
    (r2,) = sem.run_round(KEY, [sync("b", leases=[(lid, 0, 0, False)])], now=T0 + 21)
    assert (r2["leases"][0]["acknowledged"], r2["leases"][0]["expires_at"]) == (True, T0 + 81)
    assert sem.reclaim(KEY, now=T0 + 80) is None
    assert sem.usage(KEY, now=T0 + 80).lease_footprint == 4


def test_draws_reported_after_an_unacknowledged_lease_was_dropped_are_charged(
    make_semaphore: Any,
) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=4))
    (reply,) = sem.run_round(KEY, [ask("a", 4)], now=T0)
    (lid,) = lease_ids(reply)
    sem.reclaim(KEY, now=T0 + 10)
    (late,) = sem.run_round(KEY, [sync("a", leases=[(lid, 2, 0, True)])], now=T0 + 11)
    assert [(le["status"], le["acknowledged"]) for le in late["leases"]] == [("retired", False)]
    assert sem.usage(KEY, now=T0 + 11).lease_footprint == 2
    # A stale copy of that report, after the lease settled, adopts it again; its client
    # no longer knows it and never reports it again, so it is dropped once more.
    sem.run_round(KEY, [sync("a", leases=[(lid, 2, 2, True)])], now=T0 + 12)
    sem.run_round(KEY, [sync("a", leases=[(lid, 2, 0, True)])], now=T0 + 13)
    assert sem.usage(KEY, now=T0 + 13).lease_footprint == 2
    assert sem.reclaim(KEY, now=T0 + 23) is None
    assert sem.usage(KEY, now=T0 + 23).lease_footprint == 0


def test_only_a_report_sent_after_a_lease_was_adopted_acknowledges_it(
    make_semaphore: Any,
) -> None:
    # Two stale copies of one old report, in two later rounds: the first adopts the
    # settled lease again, and the second, sent before that round like the first,
    # must not acknowledge it, or it stays charged as long as its client lives.
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=4))
    (reply,) = sem.run_round(KEY, [ask("a", 4)], now=T0)
    (lid,) = lease_ids(reply)
    stale = sync("a", leases=[(lid, 1, 0, False)], seen_round=reply["round"])
    (done,) = sem.run_round(KEY, [sync("a", leases=[(lid, 1, 1, True)],
                                       seen_round=reply["round"])], now=T0 + 1)
    assert [le["status"] for le in done["leases"]] == ["settled"]
    (adopted,) = sem.run_round(KEY, [stale], now=T0 + 2)
    assert adopted["round"] == done["round"] + 1
    assert [(le["status"], le["acknowledged"]) for le in adopted["leases"]] == [
        ("retired", False)]
    (again,) = sem.run_round(KEY, [stale], now=T0 + 3)
    assert [le["acknowledged"] for le in again["leases"]] == [False]
    assert sem.reclaim(KEY, now=T0 + 12) is None
    assert sem.usage(KEY, now=T0 + 12).lease_footprint == 0
    # A client that had seen the adopting round acknowledges it: it reports the lease
    # because it knows it, as after the holder dropped it unacknowledged while it drew.
    (readopted,) = sem.run_round(KEY, [stale], now=T0 + 13)
    fresh = sync("a", leases=[(lid, 1, 0, False)], seen_round=readopted["round"])
    (acked,) = sem.run_round(KEY, [fresh], now=T0 + 14)
    assert [le["acknowledged"] for le in acked["leases"]] == [True]
    assert sem.usage(KEY, now=T0 + 30).lease_footprint == 1


def test_lowering_the_limit_retires_leases(make_semaphore: Any) -> None:
    limits = Limits(10)
    sem = make_semaphore(limits, leases=Leases(Strict()))
    (reply,) = sem.run_round(KEY, [ask("a", 1)], now=T0)
    (lid,) = lease_ids(reply)
    limits.value = 8
    (r1,) = sem.run_round(KEY, [sync("a", leases=[(lid, 1, 0, False)])], now=T0 + 1)
    assert [le["status"] for le in r1["leases"]] == ["retired"]
    assert sem.usage(KEY, now=T0 + 1).lease_footprint == 9  # in full until confirmed


def test_a_group_losing_eligibility_retires_its_leases(make_semaphore: Any) -> None:
    limits = Limits(10)
    sem = make_semaphore(limits, leases=Leases(Strict()))
    (reply,) = sem.run_round(KEY, [ask("a", 1, group="w")], now=T0)
    assert [le["status"] for le in reply["leases"]] == ["active"]
    limits.groups["w"] = 5
    (r1,) = sem.run_round(KEY, [sync("a")], now=T0 + 1)
    assert [le["status"] for le in r1["leases"]] == ["retired"]


def test_drawn_permits_are_one_shot_at_the_holder(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10), leases=Leases(Strict(), permits_per_lease=3))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 0, 1.0), ("x", 1, 1.0)],
                                           supports_leases=True)], now=T0)
    (lid,) = lease_ids(reply)
    # Releasing everything drawn does not make the lease drawable past its permits.
    (r1,) = sem.run_round(KEY, [sync("a", leases=[(lid, 3, 3, False)])], now=T0 + 1)
    (r2,) = sem.run_round(KEY, [sync("a", leases=[(lid, 5, 5, False)])], now=T0 + 2)
    assert (r2["leases"][0]["drawn"], r2["leases"][0]["released"]) == (3, 3)
    assert r1["leases"][0]["status"] == "active"
