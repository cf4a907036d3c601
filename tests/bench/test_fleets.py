"""The fleets benchmark's arithmetic on a small synthetic ledger: ideal makespan and
efficiency, the longest idle gap of a key with work waiting, each key's first-task
latency, peaks, and the burst's shape. Pure functions over ledger rows; no services."""
from __future__ import annotations

import pytest

from benchmarks.fleets import (
    DEPLOYMENTS,
    Deployment,
    Row,
    analyze,
    behind,
    first_task_ms,
    ideal_makespan,
    idle_gaps,
    makespan,
    parse,
    peaks,
    plan_tasks,
)
from benchmarks.report import fleet_lines

WF = "1:nightly-export"  # the workflow, with its ceiling of 1 in its name
# Two slots; key "1:a" (limit 1) has three 1 s tasks, key "2:b" (limit 2) two 1 s tasks,
# all published at 0.0. "a" waits 0.5 s for its first start and idles 0.5 s between its
# second and third task; "b" runs both at once from 0.1 s.
LEDGER = [
    Row(0.5, 1.5, 0.0, "1:a", None, "w0"),
    Row(1.5, 2.5, 0.0, "1:a", None, "w0"),
    Row(3.0, 4.0, 0.0, "1:a", None, "w1"),
    Row(0.1, 1.1, 0.0, "2:b", WF, "w1"),
    Row(0.1, 1.1, 0.0, "2:b", None, "w1"),
]
LIMITS = {"1:a": 1, "2:b": 2}


def test_behind_is_how_long_a_task_started_after_a_younger_one_of_its_key_and_group() -> None:
    assert behind(LEDGER) == 0.0, "tasks published together are not younger than each other"
    inverted = [
        Row(4.0, 5.0, 0.0, "1:a", None, "w0"),   # the oldest, started 3.5 s after t=0.1's
        Row(0.5, 1.5, 0.1, "1:a", None, "w1"),
        Row(1.5, 2.5, 0.2, "1:a", None, "w1"),
        Row(0.0, 9.0, 0.3, "1:a", "g", "w1"),    # another group: no order against "a"
        Row(2.0, 3.0, 0.0, "2:b", None, "w0"),
        Row(3.0, 4.0, 0.1, "2:b", None, "w0"),   # in order
    ]
    assert behind(inverted) == pytest.approx(3.5)


def test_ideal_is_the_pool_or_the_slowest_key_at_its_limit() -> None:
    # total work 5 s over 2 slots is 2.5 s; key a's 3 s at limit 1 is longer
    assert ideal_makespan(LEDGER, 2, LIMITS) == pytest.approx(3.0)
    assert ideal_makespan(LEDGER, 2) == pytest.approx(2.5)  # plain Celery: only the pool
    assert ideal_makespan(LEDGER, 1, LIMITS) == pytest.approx(5.0)  # one slot binds
    # a ceiling of 1 on b's workflow (1 s of work) does not bind; a ceiling on a 4 s one would
    assert ideal_makespan(LEDGER, 2, LIMITS, {("2:b", WF): 1}) == pytest.approx(3.0)
    heavy = [*LEDGER, *(Row(1.1, 2.1, 0.0, "2:b", WF, "w1") for _ in range(3))]
    assert ideal_makespan(heavy, 2, LIMITS, {("2:b", WF): 1}) == pytest.approx(4.0)


def test_makespan_runs_from_the_first_publish_to_the_last_end() -> None:
    assert makespan(LEDGER) == pytest.approx(4.0)


def test_idle_gap_counts_only_while_work_waits_and_nothing_runs() -> None:
    gaps = idle_gaps(LEDGER, 2)
    assert gaps["1:a"][0] == pytest.approx(0.5)  # 0-0.5 and 2.5-3.0: both 0.5 s
    assert gaps["2:b"][0] == pytest.approx(0.1)  # published at 0, started at 0.1
    # with a free slot too: during 0-0.1 nothing ran at all, 0.1-0.5 b held both slots,
    # and 2.5-3.0 had both slots free
    assert gaps["1:a"][1] == pytest.approx(0.5)
    gaps_one_slot = idle_gaps(LEDGER, 1)
    assert gaps_one_slot["1:a"][1] == pytest.approx(0.5)  # 2.5-3.0: the slot was free


def test_idle_gap_ignores_a_key_with_nothing_waiting() -> None:
    # b's work is all started by 0.1: its idle time after 1.1 is no gap
    assert idle_gaps(LEDGER[3:], 2)["2:b"] == pytest.approx((0.1, 0.1))


def test_first_task_is_the_first_published_not_the_first_started() -> None:
    rows = [Row(2.0, 3.0, 1.0, "1:a", None, "w0"), Row(1.5, 2.5, 1.2, "1:a", None, "w0"),
            Row(0.02, 1.0, 0.0, "2:b", None, "w1")]
    found = first_task_ms(rows)
    assert found["1:a"] == pytest.approx(1000.0)
    assert found["2:b"] == pytest.approx(20.0)


def test_peaks_per_key_and_per_workflow() -> None:
    assert peaks(LEDGER, lambda r: r.key) == {"1:a": 1, "2:b": 2}
    # an end and a start at the same moment (1.5) are not two at once
    assert peaks(LEDGER[:2], lambda r: r.key) == {"1:a": 1}


def test_analyze_reports_by_key_index_and_flags_a_peak_over_the_limit() -> None:
    deployment = Deployment("t", "test", (("threads", 2),), (1, 2), 5, (1.0,), workflow=1)
    keys = ["1:a", "2:b"]
    found = analyze(LEDGER, deployment, keys, admitted=True)
    assert found["efficiency"] == pytest.approx(3.0 / 4.0)
    assert found["first_ms"] == pytest.approx([500.0, 100.0])
    assert found["peaks"] == [1, 2] and found["group_peaks"] == [0, 1]
    assert found["over_limit"] == []
    crowded = [*LEDGER, Row(3.2, 3.8, 0.0, "1:a", None, "w0")]
    assert analyze(crowded, deployment, keys, admitted=True)["over_limit"] == [0]
    plain = analyze(LEDGER, deployment, keys, admitted=False)
    assert plain["efficiency"] == pytest.approx(2.5 / 4.0)


def test_parse_reads_the_ledger_fields() -> None:
    assert parse([["1.0", "2.0", "0.5", "1:a", "-", "w@h"],
                  ["1.0", "2.0", "0.5", "1:a", WF, "w@h"]]) == [
        Row(1.0, 2.0, 0.5, "1:a", None, "w@h"), Row(1.0, 2.0, 0.5, "1:a", WF, "w@h")]


def test_each_burst_gives_keys_work_in_proportion_to_their_limits() -> None:
    for deployment in DEPLOYMENTS:
        tasks = plan_tasks(deployment)
        assert len(tasks) == deployment.tasks
        work = [sum(t.work for t in tasks if t.key == k) for k in range(len(deployment.limits))]
        for k, limit in enumerate(deployment.limits):
            assert work[k] / limit == pytest.approx(work[0] / deployment.limits[0])
        assert plan_tasks(deployment) == tasks  # the same burst every pass
    quickstart = DEPLOYMENTS[2]
    assert {t.group for t in plan_tasks(quickstart)} == {None, "1:nightly-export"}


def test_the_summary_judges_admitted_runs_against_the_targets() -> None:
    deployment = Deployment("t", "test", (("threads", 2),), (1, 2), 5, (1.0,))
    keys = ["1:a", "2:b"]
    rows = []
    for variant in ("plain", "grants"):
        row = analyze(LEDGER, deployment, keys, admitted=variant != "plain")
        row.update(deployment="t", title="test", variant=variant, tasks=5, done=5, pass_=0,
                   limits=[1, 2], slots=2, settle_s=None if variant == "plain" else 0.4)
        row["pass"] = row.pop("pass_")
        rows.append(row)
    for variant, first_ms in (("plain", [3.0, 4.0]), ("grants", [12.0, 30.0, 31.0])):
        rows.append({"deployment": "free-key", "title": "(d) free keys", "variant": variant,
                     "pass": 0, "tasks": len(first_ms), "done": len(first_ms),
                     "first_ms": first_ms})
    text = "\n".join(fleet_lines(rows))
    assert "met: idle with a free slot, usage 0, peak; NOT met: efficiency" in text
    assert "grants      3    30.0    31.0  first p50 NOT met" in text
    assert text.count("NOT met") == 2  # plain Celery is the reference, not judged
