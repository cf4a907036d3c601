"""The worker_profile diagnostic's arithmetic: profiles summed over files, the admitted
side less the plain side per task, by package and by function, waiting left out.
The profiles are real cProfile dumps of small in-process runs. No services."""
from __future__ import annotations

import cProfile
import re
import time
from pathlib import Path

from benchmarks.worker_profile import Key, compare, load, package, report


def _plain_work() -> int:
    return sum(range(50))


def _extra_work() -> int:
    return sum(range(500))


def _dump(path: Path, *, extra: int, plain: int = 10) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(plain):
        _plain_work()
    for _ in range(extra):
        _extra_work()
    time.sleep(0.01)  # waiting: left out of the totals
    profile.disable()
    profile.dump_stats(str(path))
    return str(path)


def _calls(stats: dict[Key, tuple[int, float]], function: str) -> int:
    return sum(calls for key, (calls, _) in stats.items() if key[2] == function)


def test_load_sums_the_calls_of_every_file(tmp_path: Path) -> None:
    one = _dump(tmp_path / "a", extra=3)
    two = _dump(tmp_path / "b", extra=4)
    stats = load([one, two])
    assert _calls(stats, "_plain_work") == 20
    assert _calls(stats, "_extra_work") == 7


def test_compare_gives_the_admitted_sides_extra_calls_per_task(tmp_path: Path) -> None:
    plain = load([_dump(tmp_path / "p", extra=0)])
    admitted = load([_dump(tmp_path / "a", extra=20)])
    by_package, rows = compare(plain, admitted, tasks=10)
    extra = next(row for row in rows if row.where.endswith("(_extra_work)"))
    same = next(row for row in rows if row.where.endswith("(_plain_work)"))
    assert extra.calls == 2.0 and extra.own_us > 0
    assert same.calls == 0.0
    assert "(built-in, waiting)" not in by_package  # sleep is waiting, not work
    assert not any("sleep" in row.where for row in rows)
    assert by_package["(other)"] > 0  # this test module's functions


def test_package_names_libraries_by_their_folder() -> None:
    assert package(("/x/site-packages/kombu/transport/redis.py", 1, "_put")) == "kombu"
    assert package(("/work/durability_celery/worker/gate.py", 1, "submit")) == "durability_celery"
    assert package(("/usr/lib/python3.11/json/encoder.py", 1, "encode")) == "json"
    assert package(("~", 0, "<method 'poll' of 'select.epoll' objects>")) == "(built-in, waiting)"
    assert package(("~", 0, "<built-in method builtins.len>")) == "(built-in)"
    assert package(("/tmp/mine.py", 1, "f")) == "(other)"


def test_the_report_names_both_sides_and_the_largest_difference(tmp_path: Path) -> None:
    plain = load([_dump(tmp_path / "p", extra=0)])
    admitted = load([_dump(tmp_path / "a", extra=20)])
    text = report(plain, admitted, 10, variant="leases", top=3)
    assert text.startswith("main thread, per task (10 tasks per side)")
    assert "leases less plain, by package" in text
    assert re.search(r"\+2\.000 calls  test_worker_profile\.py:\d+\(_extra_work\)", text), text
    assert "by function (top 3 by time)" in text and "by function (top 3 by calls)" in text
    assert "sleep" not in text  # waiting is not work
