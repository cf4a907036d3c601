# The holder's scheduling rules with a fake clock: when each key's round
# starts (a free key's at once, a contended key's batched, promptly when capacity
# comes back), that keys never run two jobs at once, and the claim-deadline alarm.
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durability_celery.core.config import GATHER
from durability_celery.holder.batching import (
    FREE_GATHER,
    PROMPT,
    Batcher,
    Reclaim,
    Round,
    Waiting,
    given_back,
)

WAIT, PERIOD = 1.0, 2.0
K = ("jobs", "acct-1")
K2 = ("jobs", "acct-2")


def batcher() -> Batcher:
    return Batcher(lambda semaphore: (WAIT, PERIOD), max_batch=3)


def req(at: float, n: int = 0, *, released: int | None = None) -> Waiting:
    body: dict[str, object] = {"n": n, "client_id": f"client-{n}",
                               "demand": [{"group": None, "count": 1}]}
    if released is not None:
        body.update(grants=[{"grant_id": "g", "claimed": released, "released": released}])
    return Waiting(body, "reply", f"c{n}", at)


BLOCKED = {f"client-{n}": frozenset({None}) for n in range(10)}
"""A round that left every test client blocked: their next requests are parked."""


def after_one_round() -> Batcher:
    """K had its round at 1.0 and left every client blocked: told to ask again, their
    requests wait for the period (3.0) or for capacity."""
    b = batcher()
    b.add(K, req(0.0, 1))
    b.take_due(1.0)
    b.finished(K, blocked=BLOCKED)
    return b


def test_a_free_key_runs_a_request_within_a_moment() -> None:
    b = batcher()
    b.add(K, req(10.0, 1))
    b.add(K, req(10.001, 2))  # sent together with it
    assert b.round_at(K) == 10.0 + FREE_GATHER
    (job,) = b.take_due(10.0 + FREE_GATHER)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [1, 2]
    b.finished(K, blocked={"client-1": frozenset(), "client-2": frozenset()})
    b.add(K, req(10.005, 3))  # more demand just after: no period to wait, but spaced
    assert b.round_at(K) == pytest.approx(10.0 + FREE_GATHER + PROMPT)


def test_a_contended_key_batches_until_capacity_comes_back() -> None:
    b = after_one_round()
    b.add(K, req(1.01, 2))  # a blocked client asking again at once: waits for the period
    assert b.round_at(K) == 3.0 + GATHER
    b.add(K, req(1.5, 3, released=1))  # a release: its round runs a moment later
    assert b.round_at(K) == 1.5 + PROMPT
    (job,) = b.take_due(1.5 + PROMPT)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [2, 3]
    b.finished(K, blocked=BLOCKED)
    b.add(K, req(1.6, 3, released=1))  # the same report again is no news
    assert b.round_at(K) == pytest.approx(1.5 + PROMPT + PERIOD + GATHER)
    b.freed(K, 1.7)  # a reclaim gave capacity back
    assert b.round_at(K) == pytest.approx(1.7 + PROMPT)


def test_capacity_back_on_a_key_nobody_waits_for_runs_within_a_moment() -> None:
    # Nothing to coalesce returns for: the permit a free key's worker gave back, and the
    # request for its next task just after, each get a round as a fresh request does.
    b = batcher()
    b.add(K, req(10.0, 1))
    b.take_due(10.0 + FREE_GATHER)
    b.finished(K, blocked={"client-1": frozenset()})
    b.add(K, req(10.5, 1, released=1))
    assert b.round_at(K) == pytest.approx(10.5 + FREE_GATHER)


def test_rounds_of_one_contended_key_are_round_period_apart() -> None:
    b = after_one_round()
    b.add(K, req(1.5, 2))  # its round_wait ends at 2.5, the period at 3.0
    assert b.round_at(K) == 3.0 + GATHER
    assert b.take_due(3.0) == []
    assert len(b.take_due(3.0 + GATHER)) == 1


def test_requests_sent_at_next_request_at_join_a_round_a_report_waits_for() -> None:
    b = after_one_round()
    b.add(K, req(1.2, 2))  # a report that waited the period out
    b.add(K, req(3.0 + GATHER / 2, 3))  # sent at 3.0, a few milliseconds in transit
    (job,) = b.take_due(3.0 + GATHER)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [2, 3]


def test_a_request_sent_when_told_starts_the_round_a_gathering_moment_later() -> None:
    # A contended key: every reply says next_request_at = round + round_period, and the
    # blocked clients ask then. Their round starts GATHER later, not round_wait later,
    # so the key's rounds are round_period + GATHER apart, not round_period + round_wait.
    b = after_one_round()
    b.add(K, req(3.004, 2))
    assert b.round_at(K) == 3.0 + GATHER
    assert b.take_due(3.0 + GATHER - 0.001) == []
    (job,) = b.take_due(3.0 + GATHER)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [2]
    b.finished(K, blocked=BLOCKED)  # next_request_at = 3.0 + GATHER + PERIOD
    b.add(K, req(3.0 + GATHER + PERIOD + 0.004, 3))
    assert b.round_at(K) == pytest.approx(3.0 + 2 * GATHER + PERIOD)


def test_a_report_sent_just_before_the_period_ends_waits_only_for_it() -> None:
    b = after_one_round()
    b.add(K, req(2.7, 2))  # a release; round_wait would run to 3.7
    assert b.round_at(K) == 3.0 + GATHER


def test_a_blocked_client_asking_after_the_gathering_moment_waits_a_moment() -> None:
    # Past last round + period + GATHER (a busy client, or a key quiet since): a
    # round_wait more would idle the key's budget; a moment gathers what comes with it,
    # and the rounds stay a period apart.
    b = after_one_round()
    b.add(K, req(3.0 + GATHER, 2))
    assert b.round_at(K) == pytest.approx(3.0 + 2 * GATHER)
    b.add(K, req(3.0 + GATHER + 0.01, 3))  # sent with it: the same round
    (job,) = b.take_due(3.0 + 2 * GATHER)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [2, 3]


def test_the_gathering_moment_never_exceeds_round_wait() -> None:
    b = Batcher(lambda semaphore: (0.01, 0.05))
    b.add(K, req(0.0, 1))
    b.take_due(0.01)
    b.finished(K, blocked=BLOCKED)
    b.add(K, req(0.02, 2))
    assert b.round_at(K) == 0.01 + 0.05 + 0.01


def test_a_busy_key_waits_and_other_keys_do_not() -> None:
    b = batcher()
    b.add(K, req(0.0, 1))
    b.take_due(1.0)
    b.add(K, req(5.0, 2))
    b.add(K2, req(5.0, 3))
    jobs = b.take_due(10.0)
    assert [j.key_id for j in jobs] == [K2]  # K's round is still running
    assert b.next_wake() is None or b.next_wake() == 6.0
    b.finished(K)
    assert [j.key_id for j in b.take_due(10.0)] == [K]


def test_batches_are_capped_and_the_rest_waits_for_the_next_round() -> None:
    b = batcher()
    for n in range(5):
        b.add(K, req(0.0, n))
    (job,) = b.take_due(1.0)
    assert isinstance(job, Round) and len(job.requests) == 3
    b.finished(K, blocked=BLOCKED)
    # Never answered, they are not parked: their round follows as soon as rounds may.
    assert b.round_at(K) == 1.0 + PROMPT
    (job,) = b.take_due(1.0 + PROMPT)
    assert isinstance(job, Round) and [r.body["n"] for r in job.requests] == [3, 4]


def test_alarm_follows_the_earliest_deadline_and_runs_when_idle() -> None:
    b = batcher()
    b.set_alarm(K, 20.0)
    b.set_alarm(K, 15.0)
    b.set_alarm(K, 30.0)
    assert b.alarm(K) == 15.0
    assert b.next_wake() == 15.0
    assert b.take_due(14.9) == []
    (job,) = b.take_due(15.0)
    assert job == Reclaim(K)
    assert b.take_due(16.0) == []  # busy
    b.finished(K)
    b.replace_alarm(K, 25.0, now=16.0)
    assert b.alarm(K) == 25.0
    b.replace_alarm(K, 10.0, now=16.0)  # a past deadline never spins
    assert b.alarm(K) > 16.0


def test_a_round_goes_before_a_due_alarm_and_the_alarm_follows() -> None:
    b = batcher()
    b.set_alarm(K, 1.0)
    b.add(K, req(0.0, 1))
    (job,) = b.take_due(2.0)
    assert isinstance(job, Round)
    b.finished(K)
    (job,) = b.take_due(2.0)
    assert job == Reclaim(K)


def test_idle_keys_are_forgotten_after_their_period_and_gathering_moment() -> None:
    b = after_one_round()
    b.take_due(2.0)
    assert b.round_at(K) is None
    b.take_due(3.0 + GATHER)
    b.add(K, req(3.0 + GATHER, 2))
    # Forgotten, the key is new again: the old last round no longer delays it.
    assert b.round_at(K) == 3.0 + GATHER + FREE_GATHER


def test_an_idle_key_keeps_its_gathering_moment_for_the_requests_told_to_come() -> None:
    # Nothing waited through the period (no report, no demand): the told requests
    # arrive just after its end and still get their round GATHER after it.
    b = after_one_round()
    assert b.take_due(3.0) == []
    b.add(K, req(3.004, 2))
    assert b.round_at(K) == 3.0 + GATHER


def test_drop_waiting_forgets_requests() -> None:
    b = batcher()
    b.add(K, req(0.0, 1))
    b.add(K2, req(0.0, 2))
    assert len(b.drop_waiting()) == 2
    assert b.waiting_count() == 0
    assert b.take_due(10.0) == []


def test_shard_specs() -> None:
    import pytest

    from durability_celery.holder.service import parse_shards

    assert parse_shards(None, 16) is None
    assert parse_shards("", 16) is None
    assert parse_shards("0-3,9", 16) == [0, 1, 2, 3, 9]
    assert parse_shards("5, 5,2", 8) == [2, 5]
    for bad in ("0-16", "x", "3-1", "-1"):
        with pytest.raises(ValueError, match=r"is not N or N-M|is outside 0-15"):
            parse_shards(bad, 16)


def test_the_next_round_is_spaced_from_the_time_the_round_recorded() -> None:
    b = batcher()
    b.add(K, req(0.0, 1))
    b.take_due(1.0)
    # The round read its clock a little after it started.
    b.finished(K, round_at=1.02, blocked=BLOCKED)
    b.add(K, req(1.5, 2))
    assert b.round_at(K) == 1.02 + PERIOD + GATHER


def test_waiting_count_follows_adds_rounds_and_drops() -> None:
    b = batcher()
    for n in range(5):
        b.add(K, req(0.0, n))
    b.add(K2, req(0.0, 9))
    assert b.waiting_count() == 6
    b.take_due(1.0)  # K takes 3 (max_batch), K2 takes 1
    assert b.waiting_count() == 2
    b.drop_waiting()
    assert b.waiting_count() == 0


def test_a_key_whose_reclaim_found_no_deadline_is_forgotten() -> None:
    b = batcher()
    b.set_alarm(K, 5.0)
    assert b.take_due(5.0) == [Reclaim(K)]
    b.finished(K)
    b.replace_alarm(K, None, now=5.0)
    assert b.take_due(5.0) == []
    assert b.next_wake() is None  # nothing left to wake for: the slot is gone
    b.add(K, req(6.0, 1))
    assert b.round_at(K) == 6.0 + FREE_GATHER


def test_finding_what_is_due_does_not_visit_every_key() -> None:
    # 10,000 keys waiting for rounds later on: a pass that finds nothing due, or the
    # one due key, looks at no other key's timing (which each visit asks for).
    asked: list[str] = []

    def timing(semaphore: str) -> tuple[float, float]:
        asked.append(semaphore)
        return WAIT, PERIOD

    b = Batcher(timing)
    for n in range(10_000):
        b.add(("jobs", f"bulk-{n}"), req(100.0 + n / 1000, n))
    b.add(K, req(0.0, -1))
    asked.clear()
    assert b.take_due(50.0) == [Round(K, (req(0.0, -1),))]
    assert len(asked) <= 2
    assert b.next_wake() == 100.0 + FREE_GATHER  # K is busy: the first of the others
    b.finished(K)
    assert b.next_wake() == 50.0 + PERIOD + GATHER  # K may be forgotten then
    jobs = b.take_due(100.0 + FREE_GATHER + 0.0005)  # and the first of the 10,000 is due
    assert [j.key_id for j in jobs] == [("jobs", "bulk-0")]
    assert len(asked) <= 6
    assert b.round_at(K) is None and b.next_wake() == 100.001 + FREE_GATHER


@given(st.lists(st.tuples(st.sampled_from(["add", "release", "alarm", "tick", "finish",
                                           "contend"]),
                          st.integers(0, 4), st.floats(0.0, 3.0)), max_size=80))
@settings(max_examples=300, deadline=None)
def test_take_due_returns_exactly_the_due_jobs_and_wakes_are_never_late(
        steps: list[tuple[str, int, float]]) -> None:
    # The heap must agree with a scan of every key: at each tick, a job for each key
    # that is not busy and whose round (round_at) or alarm is due, and for no other;
    # and next_wake is never later than any such time still to come.
    b = batcher()
    keys = [("jobs", f"k{n}") for n in range(5)]
    busy: set[tuple[str, str]] = set()
    now = 0.0
    for op, n, x in steps:
        key = keys[n]
        if op == "add":
            b.add(key, req(now + x / 10, n))
        elif op == "release":
            b.add(key, req(now + x / 10, n, released=int(x * 10)))
        elif op == "alarm":
            b.set_alarm(key, now + x)
        elif op in ("finish", "contend") and key in busy:
            busy.discard(key)
            groups = frozenset({None}) if op == "contend" else frozenset()
            b.finished(key, blocked={f"client-{m}": groups for m in range(5)})
        elif op == "tick":
            now += x
            due = {}
            for k in keys:
                if k in busy:
                    continue
                round_at, alarm = b.round_at(k), b.alarm(k)
                if round_at is not None and round_at <= now:
                    due[k] = Round
                elif alarm is not None and alarm <= now:
                    due[k] = Reclaim
            jobs = b.take_due(now)
            assert {j.key_id: type(j) for j in jobs} == due
            assert len(jobs) == len(due)
            busy |= set(due)
            upcoming = [t for k in keys if k not in busy
                        for t in (b.round_at(k), b.alarm(k)) if t is not None]
            if upcoming:
                wake = b.next_wake()
                assert wake is not None and wake <= min(upcoming)


def test_a_new_client_of_a_contended_key_gets_a_round_at_once() -> None:
    # Only the clients a round left blocked are parked: another worker's first demand
    # (perhaps for a group with room) is answered within a moment, then parked if it
    # too is blocked.
    b = after_one_round()
    b.add(K, req(1.5, 2))  # parked
    b.add(K, Waiting({"client_id": "newcomer", "demand": [{"group": None, "count": 1}]},
                      "reply", "cx", 1.6))
    assert b.round_at(K) == pytest.approx(1.6 + FREE_GATHER)
    (job,) = b.take_due(1.6 + FREE_GATHER)
    assert isinstance(job, Round) and len(job.requests) == 2
    b.finished(K, blocked={"newcomer": frozenset({None}), "client-2": frozenset()})
    b.add(K, Waiting({"client_id": "newcomer", "demand": [{"group": None, "count": 1}]},
                      "reply", "cy", 1.7))
    assert b.round_at(K) == pytest.approx(1.6 + FREE_GATHER + PERIOD + GATHER)
    b.add(K, req(1.8, 2))  # served last round: no longer parked
    assert b.round_at(K) == pytest.approx(1.8 + FREE_GATHER)


def test_a_blocked_client_asking_for_another_group_is_not_parked() -> None:
    # Blocked by a group's ceiling, a client's demand for a group with room must not
    # wait for the key's period.
    b = batcher()
    b.add(K, req(0.0, 1))
    b.take_due(1.0)
    b.finished(K, blocked={"client-1": frozenset({"capped"})})
    capped = {"client_id": "client-1", "demand": [{"group": "capped", "count": 2}]}
    b.add(K, Waiting(capped, "reply", "c1", 1.1))
    assert b.round_at(K) == pytest.approx(3.0 + GATHER)
    both = {"client_id": "client-1",
            "demand": [{"group": "capped", "count": 2}, {"group": None, "count": 1}]}
    b.add(K, Waiting(both, "reply", "c2", 1.2))
    assert b.round_at(K) == pytest.approx(1.2 + FREE_GATHER)


def test_a_report_alone_is_never_parked_and_news_is_per_grant() -> None:
    b = after_one_round()
    sync = {"client_id": "client-1", "grants": [{"grant_id": "a", "claimed": 1, "released": 0}]}
    b.add(K, Waiting(sync, "reply", "s1", 1.1))  # a claim: its client awaits the answer
    assert b.round_at(K) == pytest.approx(1.1 + FREE_GATHER)
    b.take_due(1.1 + FREE_GATHER)
    b.finished(K, blocked=BLOCKED)
    # A release beyond what the client's last request listed for that grant: news.
    b.add(K, Waiting({"client_id": "client-1", "demand": [{"group": None, "count": 1}],
                      "grants": [{"grant_id": "a", "claimed": 1, "released": 1}]},
                     "reply", "s2", 1.2))
    assert b.round_at(K) == pytest.approx(1.2 + PROMPT)


def test_a_round_that_blocks_nobody_unparks_everyone() -> None:
    # Capacity came back and went to nobody (no one who asked in that round was
    # blocked): a client blocked before asks next with nothing to wait for.
    b = after_one_round()
    b.add(K, req(1.1, 3, released=1))
    assert len(b.take_due(1.1 + PROMPT)) == 1
    b.finished(K, blocked={"client-3": frozenset()})
    b.add(K, req(1.2, 2))  # blocked by the first round, now not parked
    assert b.round_at(K) == pytest.approx(1.2 + FREE_GATHER)


def test_take_due_takes_at_most_limit_jobs_and_keeps_the_rest_due() -> None:
    b = batcher()
    keys = [("jobs", f"acct-{n}") for n in range(5)]
    for n, key in enumerate(keys):
        b.add(key, req(10.0 + n * 0.001, n))
    now = 11.0
    first = b.take_due(now, limit=2)
    assert [job.key_id for job in first] == keys[:2]  # earliest due first
    rest = b.take_due(now)
    assert [job.key_id for job in rest] == keys[2:]
    assert b.take_due(now) == []


def test_with_no_room_take_due_still_clears_wakes_that_start_no_job() -> None:
    # A key whose only job was a reclaim has nothing left to space: its slot is to be
    # forgotten at once. With every round thread busy (limit 0) that wake must still
    # go, or the holder reads its lag as now minus minus infinity.
    b = batcher()
    b.set_alarm(K, 5.0)
    assert b.take_due(5.0) == [Reclaim(K)]
    b.finished(K)
    b.add(K2, req(5.5, 1))
    due = b.round_at(K2)
    assert due is not None and due <= 6.0
    assert b.take_due(6.0, limit=0) == []
    assert b.next_wake() == due  # the due round stays on top, and says how late it is
    (job,) = b.take_due(6.0, limit=1)
    assert isinstance(job, Round) and job.key_id == K2
    assert b.next_wake() is None  # and K's slot was forgotten on the way


def test_given_back_reads_well_formed_reports_and_skips_the_rest() -> None:
    body: dict[str, object] = {
        "grants": [{"grant_id": "g1", "released": 2}, {"grant_id": 7, "released": 1},
                   "junk", {"grant_id": "g2", "released": True}],
        "leases": [{"lease_id": "l1", "released": 3, "stopped": True},
                   {"lease_id": "l2", "stopped": "yes"}],
    }
    assert given_back(body) == {"g1": 2, "g2": 0, "l1": 4, "l2": 0}
    assert given_back({"grants": "junk", "leases": None}) == {}
