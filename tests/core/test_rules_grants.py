# Every rule of the spec for grants, as a table-driven suite that runs on the
# pure core, SQLite and PostgreSQL: oldest-first allocation, limits and group
# ceilings, blocked attribution, cumulative reports, reclaim, live limits.
from __future__ import annotations

from typing import Any

import pytest
from core_harness import KEY, Limits, blocked, granted, request, sync

T0 = 1_000.0


def ids(response: dict[str, Any]) -> list[str]:
    return [g["grant_id"] for g in response["grants"]]


def test_oldest_demand_first_across_clients(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(5))
    newer, older, oldest = sem.run_round(KEY, [
        request("a", [(None, 4, 30.0)]),
        request("b", [(None, 4, 20.0)]),
        request("c", [(None, 2, 10.0)]),
    ], now=T0)
    assert (granted(oldest), granted(older), granted(newer)) == (2, 3, 0)
    assert blocked(newer) == {None: ("limit", 4)}
    assert blocked(older) == {None: ("limit", 1)}
    assert all(r["contended"] for r in (newer, older, oldest))


def test_arrival_order_breaks_ties(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(3))
    first, second = sem.run_round(KEY, [
        request("a", [(None, 2, 10.0)]), request("b", [(None, 2, 10.0)])
    ], now=T0)
    assert (granted(first), granted(second)) == (2, 1)


def aged(message: dict[str, Any], *ages: list[float]) -> dict[str, Any]:
    """`message` with each demand entry listing its items' enqueue times."""
    for entry, times in zip(message["demand"], ages, strict=True):
        entry["queued_at"] = times
    return message


def test_listed_items_are_granted_oldest_first_across_clients(make_semaphore: Any) -> None:
    # Two workers fed by one broker hold interleaved work: the oldest items win,
    # wherever they are queued, not the demand whose first item is oldest.
    sem = make_semaphore(Limits(4))
    first, second = sem.run_round(KEY, [
        aged(request("a", [(None, 4, 10.0)]), [10.0, 30.0, 50.0, 70.0]),
        aged(request("b", [(None, 4, 20.0)]), [20.0, 40.0, 60.0, 80.0]),
    ], now=T0)
    assert (granted(first), granted(second)) == (2, 2)
    assert blocked(first) == blocked(second) == {None: ("limit", 2)}


def test_unlisted_items_count_at_the_last_listed_time(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(5))
    first, second, whole = sem.run_round(KEY, [
        aged(request("a", [(None, 4, 10.0)]), [10.0, 30.0]),  # 10, 30, 30, 30
        aged(request("b", [(None, 2, 20.0)]), [20.0, 31.0]),
        request("c", [(None, 3, 25.0)]),  # no times: all three at 25
    ], now=T0)
    # 10 (a), 20 (b), 25 x 3 (c): the limit is reached before a's items at 30.
    assert (granted(first), granted(second), granted(whole)) == (1, 1, 3)


def ready(message: dict[str, Any], *counts: int) -> dict[str, Any]:
    """`message` with each demand entry saying how many of its items can start now."""
    for entry, count in zip(message["demand"], counts, strict=True):
        entry["ready"] = count
    return message


def test_items_that_can_start_now_are_granted_before_older_ones_that_would_wait(
        make_semaphore: Any) -> None:
    # A full worker holds the oldest item; one with a free slot a younger one: the permit
    # goes where it runs at once. Then oldest first again among items that would wait.
    sem = make_semaphore(Limits(3))
    full, free, spare = sem.run_round(KEY, [
        ready(aged(request("a", [(None, 2, 10.0)]), [10.0, 11.0]), 0),
        ready(aged(request("b", [(None, 3, 20.0)]), [20.0, 21.0, 22.0]), 1),
        request("c", [(None, 1, 15.0)]),  # says nothing: all of it can start
    ], now=T0)
    assert (granted(full), granted(free), granted(spare)) == (1, 1, 1)
    assert blocked(full) == {None: ("limit", 1)} and blocked(free) == {None: ("limit", 2)}


def test_a_demand_granted_its_ready_items_waits_behind_older_waiting_items(
        make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(3))
    straddling, waiting = sem.run_round(KEY, [
        ready(aged(request("a", [(None, 3, 20.0)]), [20.0, 21.0, 22.0]), 1),
        ready(aged(request("b", [(None, 2, 10.0)]), [10.0, 11.0]), 0),
    ], now=T0)
    assert (granted(straddling), granted(waiting)) == (1, 2)


def test_a_group_ceiling_cuts_one_demand_short_and_younger_items_go_on(
    make_semaphore: Any,
) -> None:
    sem = make_semaphore(Limits(10, groups={"w": 2}))
    first, second = sem.run_round(KEY, [
        aged(request("a", [("w", 3, 10.0), (None, 2, 40.0)]), [10.0, 11.0, 12.0], [40.0, 41.0]),
        aged(request("b", [("w", 2, 20.0)]), [20.0, 21.0]),
    ], now=T0)
    by_group = {g["group"]: g["permits"] for g in first["grants"]}
    assert by_group == {"w": 2, None: 2} and granted(second) == 0
    assert blocked(first) == {"w": ("group_limit", 1)}
    assert blocked(second) == {"w": ("group_limit", 2)}


def waiting(response: dict[str, Any]) -> dict[str | None, tuple[str, list[float]]]:
    return {w["group"]: (w["reason"], w["queued_at"]) for w in response.get("waiting", [])}


def test_a_reply_lists_the_items_other_clients_could_start_now_left_waiting(
    make_semaphore: Any,
) -> None:
    sem = make_semaphore(Limits(2, deny={("c", None)}))
    first, second, refused = sem.run_round(KEY, [
        aged(request("a", [(None, 3, 10.0)]), [10.0, 11.0, 12.0]),
        ready(aged(request("b", [(None, 3, 5.0)]), [5.0, 20.0, 21.0]), 2),
        request("c", [(None, 1, 1.0)]),
    ], now=T0)
    assert (granted(first), granted(second), granted(refused)) == (1, 1, 0)
    # b's item at 21 waits for a slot and c's is refused: a permit given back serves
    # neither, so neither is listed; nor is a client's own.
    assert waiting(first) == {None: ("limit", [20.0])}
    assert waiting(second) == {None: ("limit", [11.0, 12.0])}
    assert waiting(refused) == {None: ("limit", [11.0, 12.0, 20.0])}


def test_items_a_group_ceiling_holds_back_are_listed_as_its_own(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10, groups={"w": 2}))
    first, second = sem.run_round(KEY, [
        aged(request("a", [("w", 3, 10.0), (None, 2, 40.0)]), [10.0, 11.0, 12.0], [40.0, 41.0]),
        aged(request("b", [("w", 2, 20.0)]), [20.0, 21.0]),
    ], now=T0)
    assert waiting(first) == {"w": ("group_limit", [20.0, 21.0])}
    assert waiting(second) == {"w": ("group_limit", [12.0])}


def free(response: dict[str, Any]) -> dict[str | None, int]:
    return {f["group"]: f["permits"] for f in response.get("free", [])}


def test_a_reply_says_what_a_new_grant_of_each_group_could_still_get(make_semaphore: Any) -> None:
    # Beyond the spec: a worker keeps a finished task's permit for its key's next task
    # longer while others' requests would be served from what is free.
    sem = make_semaphore(Limits(10, groups={"w": 3, "x": None}))
    (reply,) = sem.run_round(KEY, [
        request("a", [("w", 2, 1.0), ("x", 1, 2.0), (None, 4, 3.0)])], now=T0)
    assert free(reply) == {None: 3, "w": 1, "x": 3}
    first, second = sem.run_round(KEY, [
        sync("a", grants=[(g["grant_id"], 0, 0) for g in reply["grants"]]),
        request("b", [(None, 5, 4.0)])], now=T0 + 2.0)
    assert free(first)[None] == free(second)[None] == 0 and set(free(first).values()) == {0}


def test_a_round_of_many_groups_tells_each_client_of_its_own_groups(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(100, groups={f"g{n}": 2 for n in range(10)}))
    first, second = sem.run_round(KEY, [
        request("a", [(f"g{n}", 1, 1.0) for n in range(5)]),
        request("b", [(f"g{n}", 1, 2.0) for n in range(5, 10)] + [(None, 1, 2.0)]),
    ], now=T0)
    assert free(first) == {None: 89, **{f"g{n}": 1 for n in range(5)}}
    assert free(second) == {None: 89, **{f"g{n}": 1 for n in range(5, 10)}}


def test_a_round_whose_limit_failed_says_nothing_of_free_permits(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(lambda key: 1 // 0))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 1, 1.0)])], now=T0)
    assert granted(reply) == 0 and "free" not in reply


def test_uncontended_round_grants_everything(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10))
    (reply,) = sem.run_round(KEY, [request("a", [("w", 3, 1.0), (None, 2, 2.0)])], now=T0)
    assert granted(reply) == 5 and not reply["contended"] and reply["blocked"] == []
    assert "waiting" not in reply
    assert {g["group"] for g in reply["grants"]} == {"w", None}
    assert reply["next_request_at"] == T0 + 2.0 and reply["round_at"] == T0
    assert all(g["claim_deadline"] == T0 + 10.0 for g in reply["grants"])


@pytest.mark.parametrize(
    ("groups", "deny", "expected"),
    [
        ({"w": 2}, set(), {"w": ("group_limit", 3)}),
        ({}, {("a", "w")}, {"w": ("not_permitted", 5)}),
        ({"w": ValueError("boom")}, set(), {"w": ("limit_resolution_error", 5)}),
        ({"w": -1}, set(), {"w": ("limit_resolution_error", 5)}),
        ({"w": "3"}, set(), {"w": ("limit_resolution_error", 5)}),
    ],
    ids=["group_limit", "not_permitted", "raising", "negative", "not-an-int"],
)
def test_blocked_attribution_fails_only_that_group(
    make_semaphore: Any, groups: dict[str, Any], deny: set[Any], expected: dict[str, Any]
) -> None:
    sem = make_semaphore(Limits(100, groups=groups, deny=deny))
    (reply,) = sem.run_round(KEY, [request("a", [("w", 5, 1.0), ("other", 4, 2.0)])], now=T0)
    assert blocked(reply) == expected
    by_group = {g["group"]: g["permits"] for g in reply["grants"]}
    assert by_group["other"] == 4
    assert by_group.get("w", 0) == 5 - expected["w"][1]


def test_limit_that_raises_admits_nothing(make_semaphore: Any) -> None:
    def broken(key: str) -> int:
        raise RuntimeError("config service down")

    sem = make_semaphore(Limits(broken))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0)])], now=T0)
    assert granted(reply) == 0
    assert blocked(reply) == {None: ("limit_resolution_error", 2)}


def test_limits_resolved_once_per_round(make_semaphore: Any) -> None:
    limits = Limits(10, groups={"w": 5})
    sem = make_semaphore(limits)
    sem.run_round(KEY, [request(c, [("w", 1, 1.0), ("v", 1, 1.0)]) for c in "abcd"], now=T0)
    assert limits.calls["limit"] == 1
    assert limits.group_calls == {"w": 1, "v": 1}


def test_group_ceiling_counts_every_client(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10, groups={"w": 3}))
    replies = sem.run_round(KEY, [request(c, [("w", 2, float(i))]) for i, c in enumerate("abc")],
                            now=T0)
    assert [granted(r) for r in replies] == [2, 1, 0]
    assert blocked(replies[2]) == {"w": ("group_limit", 2)}


def test_reports_are_clamped_high_water_marks(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(4))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 4, 1.0)])], now=T0)
    (gid,) = ids(reply)
    # Over-claim is clamped to the grant; a stale (reordered) report cannot move back.
    (r1,) = sem.run_round(KEY, [sync("a", grants=[(gid, 9, 3)])], now=T0 + 1)
    assert r1["grants"][0]["claimed"] == 4 and r1["grants"][0]["released"] == 3
    (r2,) = sem.run_round(KEY, [sync("a", grants=[(gid, 2, 1)])], now=T0 + 2)
    assert (r2["grants"][0]["claimed"], r2["grants"][0]["released"]) == (4, 3)
    # The same release reported twice frees one permit, not two.
    sem.run_round(KEY, [sync("a", grants=[(gid, 4, 3)])], now=T0 + 3)
    (r3,) = sem.run_round(KEY, [request("b", [(None, 5, 1.0)])], now=T0 + 4)
    assert granted(r3) == 3
    assert sem.usage(KEY, now=T0 + 4).outstanding == 4


def test_finished_grant_is_removed_and_then_not_found(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(2))
    (reply,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0)])], now=T0)
    (gid,) = ids(reply)
    (done,) = sem.run_round(KEY, [sync("a", grants=[(gid, 2, 2)])], now=T0 + 1)
    assert done["grants"][0]["status"] == "not_found"
    assert sem.usage(KEY, now=T0 + 1).outstanding == 0


def test_unclaimed_permits_are_reclaimed_after_grant_timeout(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(4), grant_timeout=5.0)
    (reply,) = sem.run_round(KEY, [request("a", [(None, 4, 1.0)])], now=T0)
    (gid,) = ids(reply)
    sem.run_round(KEY, [sync("a", grants=[(gid, 1, 0)])], now=T0 + 1)
    assert sem.reclaim(KEY, now=T0 + 4.9) == T0 + 5.0
    assert sem.usage(KEY, now=T0 + 4.9).outstanding == 4
    assert sem.reclaim(KEY, now=T0 + 5.0) is None
    assert sem.usage(KEY, now=T0 + 5).outstanding == 1
    # A late claim is answered with the clamped count and status expired.
    (late,) = sem.run_round(KEY, [sync("a", grants=[(gid, 3, 0)])], now=T0 + 6)
    assert (late["grants"][0]["status"], late["grants"][0]["claimed"],
            late["grants"][0]["permits"]) == ("expired", 1, 1)


def test_grant_never_claimed_is_deleted_by_reclaim(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(4), grant_timeout=5.0)
    (reply,) = sem.run_round(KEY, [request("a", [(None, 4, 1.0)])], now=T0)
    (gid,) = ids(reply)
    assert sem.reclaim(KEY, now=T0 + 5) is None
    (late,) = sem.run_round(KEY, [sync("a", grants=[(gid, 2, 0)])], now=T0 + 6)
    assert late["grants"][0]["status"] == "not_found"
    assert sem.usage(KEY, now=T0 + 5).outstanding == 0


def test_round_reclaims_before_allocating(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(3), grant_timeout=5.0)
    sem.run_round(KEY, [request("a", [(None, 3, 1.0)])], now=T0)
    (reply,) = sem.run_round(KEY, [request("b", [(None, 3, 2.0)])], now=T0 + 6)
    assert granted(reply) == 3


def test_lowering_the_limit_never_revokes_running_work(make_semaphore: Any) -> None:
    limits = Limits(6)
    sem = make_semaphore(limits)
    (reply,) = sem.run_round(KEY, [request("a", [(None, 6, 1.0)])], now=T0)
    (gid,) = ids(reply)
    sem.run_round(KEY, [sync("a", grants=[(gid, 6, 0)])], now=T0 + 1)
    limits.value = 2
    (r1,) = sem.run_round(KEY, [request("b", [(None, 1, 1.0)]),], now=T0 + 2)
    assert granted(r1) == 0 and blocked(r1) == {None: ("limit", 1)}
    assert sem.usage(KEY, now=T0 + 2).outstanding == 6
    sem.run_round(KEY, [sync("a", grants=[(gid, 6, 4)])], now=T0 + 3)
    (r2,) = sem.run_round(KEY, [request("b", [(None, 1, 1.0)])], now=T0 + 4)
    assert granted(r2) == 0  # 2 still running, at the new ceiling
    sem.run_round(KEY, [sync("a", grants=[(gid, 6, 5)])], now=T0 + 5)
    (r3,) = sem.run_round(KEY, [request("b", [(None, 1, 1.0)])], now=T0 + 6)
    assert granted(r3) == 1


def test_replies_say_over_limit_while_more_is_held_than_a_lowered_ceiling(
        make_semaphore: Any) -> None:
    """Clients pass permits between their tasks; `over_limit` tells them to stop, so a
    lowered limit bites as running tasks end."""
    limits = Limits(4, groups={"g": 3})
    sem = make_semaphore(limits)
    (reply,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0), ("g", 2, 1.0)])], now=T0)
    assert reply["over_limit"] is False and granted(reply) == 4
    gids = ids(reply)
    claims = [(gid, 2, 0) for gid in gids]
    limits.value = 3  # 4 held, ceiling 3
    (r1,) = sem.run_round(KEY, [sync("a", grants=claims)], now=T0 + 1)
    assert r1["over_limit"] is True
    limits.value = 4  # at the ceiling is not over it
    (r2,) = sem.run_round(KEY, [sync("a", grants=claims)], now=T0 + 2)
    assert r2["over_limit"] is False
    limits.groups["g"] = 1  # group g holds 2 of its new ceiling 1
    (r3,) = sem.run_round(KEY, [sync("a", grants=claims)], now=T0 + 3)
    assert r3["over_limit"] is True
    limits.groups["g"] = RuntimeError("down")  # fails closed
    (r4,) = sem.run_round(KEY, [sync("a", grants=claims)], now=T0 + 4)
    assert r4["over_limit"] is True
    limits.groups["g"] = None
    limits.value = lambda key: 1 // 0  # the limit callback itself fails
    (r5,) = sem.run_round(KEY, [sync("a", grants=claims)], now=T0 + 5)
    assert r5["over_limit"] is True


def test_reply_lists_every_live_grant_so_a_lost_reply_is_recovered(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(5))
    (lost,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0)])], now=T0)
    (again,) = sem.run_round(KEY, [request("a", [(None, 2, 1.0)])], now=T0 + 2)
    assert ids(lost)[0] in ids(again)
    assert granted(again) == 4


def test_a_client_asking_twice_in_one_round_is_counted_once(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(10))
    first, second = sem.run_round(KEY, [
        request("a", [(None, 3, 1.0)]), request("a", [(None, 3, 1.0)])
    ], now=T0)
    assert granted(first) == granted(second) == 3
    assert sem.usage(KEY, now=T0).outstanding == 3


def test_usage_per_group_and_blocked(make_semaphore: Any) -> None:
    sem = make_semaphore(Limits(5, groups={"w": 2}))
    sem.run_round(KEY, [request("a", [("w", 4, 1.0), (None, 2, 2.0)])], now=T0)
    usage = sem.usage(KEY, now=T0)
    assert (usage.limit, usage.outstanding, usage.lease_footprint) == (5, 4, 0)
    groups = {g.group: (g.outstanding, g.limit) for g in usage.groups}
    assert groups == {"w": (2, 2), None: (2, None)}
    assert [(b.group, b.reason, b.queued) for b in usage.blocked] == [("w", "group_limit", 2)]
    assert usage.grants == 2


def test_usage_says_why_a_live_limit_is_unknown(make_semaphore: Any) -> None:
    limits = Limits(5)
    sem = make_semaphore(limits)
    sem.run_round(KEY, [request("a", [(None, 2, 1.0)])], now=T0)
    assert sem.usage(KEY, now=T0).limit_error is None

    def broken(key: str) -> int:
        raise LookupError("no plan for acct\nsecond line")

    limits.value = broken
    usage = sem.usage(KEY, now=T0)
    assert (usage.limit, usage.outstanding) == (5, 2)  # the last round's limit, still counted
    assert usage.limit_error == "limit callback raised LookupError: no plan for acct"
    limits.value = -1  # type: ignore[assignment]
    assert sem.usage(KEY, now=T0).limit_error == (
        "limit callback returned -1, not a count from 0 to 1000000000")
