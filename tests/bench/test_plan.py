"""What a narrowed benchmark run (`--passes`, `--pools`, `--targets-only`) runs and where
it writes. Pure: the plan alone, no services."""
from __future__ import annotations

import pytest

from benchmarks.plan import customize, make_plan


def test_the_full_plan_runs_every_variant_in_its_first_pass_and_the_targets_after() -> None:
    plan = make_plan(False)
    assert plan.suffix == ""
    first, later = plan.pass_variants(0), plan.pass_variants(2)
    assert later == ("plain", "leases", "plain", "grants", "plain")
    assert set(first) - set(later) == {"diy", "leases_oneshot", "grants_oneshot",
                                       "leases_fast", "grants_fast"}
    assert first[::2] == ("plain",) * (len(first) // 2 + 1)  # every run between two plain


def test_the_variants_with_targets_take_turns_going_first() -> None:
    plan = make_plan(False)
    assert [plan.pass_variants(n)[1] for n in range(4)] == ["leases", "grants"] * 2
    assert plan.pass_variants(1) == ("plain", "grants", "plain", "leases", "plain")
    assert [plan.targets(n) for n in range(2)] == [("leases", "grants"), ("grants", "leases")]


def test_no_option_changes_nothing() -> None:
    plan = make_plan(False)
    assert customize(plan) is plan


def test_a_narrowed_run_writes_files_of_its_own() -> None:
    plan = customize(make_plan(False), passes=12, pools=("threads",), targets_only=True)
    assert (plan.overhead_passes, plan.overhead_pools, plan.solo_passes) == (12, ("threads",), 0)
    assert plan.pass_variants(0) == ("plain", "leases", "plain", "grants", "plain")
    assert plan.raised_hold_keys == 0
    assert plan.suffix == "-custom"
    assert customize(make_plan(True), passes=2).suffix == "-quick"


def test_solo_listed_runs_the_same_passes() -> None:
    plan = customize(make_plan(False), passes=7, pools=("solo", "prefork"))
    assert (plan.overhead_pools, plan.solo_passes) == (("prefork",), 7)
    assert plan.pass_variants(0) == make_plan(False).pass_variants(0)


def test_key_counts_narrow_to_those_listed() -> None:
    plan = customize(make_plan(False), keys=(16,))
    assert (plan.overhead_keys, plan.suffix) == ((16,), "-custom")


@pytest.mark.parametrize("options", [{"passes": 0}, {"passes": 51}, {"pools": ("gevent",)},
                                     {"pools": ()}, {"keys": (4,)}, {"keys": ()}])
def test_counts_and_pools_it_cannot_run_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"(passes|pools|keys) must be"):
        customize(make_plan(False), **options)  # type: ignore[arg-type]
