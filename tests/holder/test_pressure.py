# Back-pressure (holder/pressure.py) on a fake clock: lag past its target stretches
# the periods and the replies' next_request_at by the same seconds, within caps; it shrinks
# back once the lag is gone (not before the clients told the stretch asked again; fast far
# under the target, gradually near it), and the holder says so (state and log); the batcher
# serves parked requests by the period their key's last round told.
from __future__ import annotations

import pytest

from durability_celery.core.config import GATHER
from durability_celery.holder import pressure as pressure_module
from durability_celery.holder.batching import Batcher, Waiting
from durability_celery.holder.pressure import (
    FAST_SHRINK,
    MAX_STRETCH,
    MAX_STRETCHED_PERIOD,
    SHRINK,
    SPREAD,
    Pressure,
)

PERIOD = 2.0


def reply(round_at: float, *, blocked: bool = False) -> dict[str, object]:
    return {"round_at": round_at, "next_request_at": round_at if blocked else round_at + PERIOD}


def behind(pressure: Pressure, start: float, seconds: float, lag: float) -> float:
    """Looks every 0.1 s for `seconds`, each finding the earliest due job `lag` late."""
    now = start
    while now < start + seconds:
        pressure.observe(now, lag, waiting=500)
        now += 0.1
    return now


def test_lag_past_its_target_stretches_periods_and_replies(
        caplog: pytest.LogCaptureFixture) -> None:
    pressure = Pressure(lambda: PERIOD)
    behind(pressure, 0.0, 5.0, lag=0.1)  # under the target (a quarter period)
    assert (pressure.extra, pressure.overloaded) == (0.0, False)
    answer = reply(10.0)
    pressure.stretch_reply(answer, PERIOD)
    assert answer["next_request_at"] == 12.0
    with caplog.at_level("WARNING", logger="durability_celery.holder"):
        behind(pressure, 5.0, 10.0, lag=2.5)
    # The lag past its target (a quarter period), however many looks saw it: summed
    # over them, it would stretch past what the holder serves and leave it idle.
    assert pressure.overloaded and pressure.extra == pytest.approx(2.5 - PERIOD / 4)
    assert pressure.period(PERIOD) == min(PERIOD + pressure.extra, MAX_STRETCH * PERIOD)
    assert caplog.text.count("overloaded") == 1  # once, not per look
    for blocked in (False, True):  # a blocked client is told to wait as well
        answer = reply(10.0, blocked=blocked)
        pressure.stretch_reply(answer, PERIOD)
        assert answer["next_request_at"] == 10.0 + pressure.period(PERIOD)
    error = {"v": 1, "error": {"code": "unavailable", "message": "x"}}
    pressure.stretch_reply(error, PERIOD)
    assert "next_request_at" not in error
    assert pressure.view().waiting == 500


def test_each_round_is_told_its_own_share_of_the_stretch() -> None:
    # Stretched by the same seconds, keys that asked together would ask together again,
    # and the tail of their wave could hold the lag past its target: each round's replies
    # are told the extra less a random share of it, the same for all its clients.
    pressure = Pressure(lambda: PERIOD)
    behind(pressure, 0.0, 5.0, lag=2.5)
    extra = pressure.extra
    told = set()
    for _ in range(200):
        share = pressure.spread()
        answers = [reply(10.0), reply(10.0, blocked=True)]
        for answer in answers:
            pressure.stretch_reply(answer, PERIOD, share)
        assert answers[0]["next_request_at"] == answers[1]["next_request_at"]
        told.add(answers[0]["next_request_at"])
    assert min(told) >= 10.0 + PERIOD + extra * (1 - SPREAD)
    assert max(told) <= 10.0 + PERIOD + extra
    assert max(told) - min(told) > extra * SPREAD / 2  # spread, not one value


def test_periods_are_stretched_by_the_same_seconds_within_their_caps() -> None:
    # One holder, a short and a long period: the lag is seconds for both, so both are
    # told the same seconds more, each at most MAX_STRETCH times (or the longest period).
    pressure = Pressure(lambda: 0.05)
    behind(pressure, 0.0, 2.0, lag=1.0)
    extra = pressure.extra
    assert 0.5 < extra < MAX_STRETCHED_PERIOD
    assert pressure.period(0.05) == pytest.approx(0.05 + extra)
    assert pressure.period(PERIOD) == pytest.approx(PERIOD + extra)
    behind(pressure, 2.0, 300.0, lag=30.0)
    assert pressure.period(0.05) == MAX_STRETCHED_PERIOD
    assert pressure.period(PERIOD) == MAX_STRETCH * PERIOD


def test_without_lag_the_stretch_shrinks_back_and_the_overload_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    pressure = Pressure(lambda: PERIOD)
    now = behind(pressure, 0.0, 20.0, lag=3.0)
    stretched = pressure.extra
    # The clients told the stretch ask again a stretched period after their rounds:
    # until then no lag says the holder has room, and nothing shrinks.
    now = behind(pressure, now, PERIOD + stretched - 0.5, lag=0.0)
    assert pressure.extra == stretched
    # Then, with requests waiting far under the target, it halves each period.
    now = behind(pressure, now, 1.0, lag=0.0)
    assert pressure.extra == pytest.approx(stretched * FAST_SHRINK)
    now = behind(pressure, now, PERIOD, lag=0.0)
    assert pressure.extra == pytest.approx(stretched * FAST_SHRINK ** 2)
    # Near the target, gradually.
    now = behind(pressure, now, PERIOD, lag=0.2)
    assert pressure.extra == pytest.approx(stretched * FAST_SHRINK ** 2 * SHRINK)
    with caplog.at_level("INFO", logger="durability_celery.holder"):
        behind(pressure, now, 10 * PERIOD, lag=0.0)
    assert (pressure.extra, pressure.overloaded) == (0.0, False)
    assert "no longer overloaded" in caplog.text


def test_a_long_lag_is_overload_even_before_a_stretch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pressure_module, "OVERLOAD_LAG", 0.5)
    pressure = Pressure(lambda: 100.0)  # a long period: no stretch for a lag of 0.6 s
    pressure.observe(0.0, 0.6, waiting=1)
    assert pressure.overloaded and pressure.extra == 0.0
    behind(pressure, 0.1, 250.0, lag=0.0)
    assert not pressure.overloaded and pressure.view().lag == 0.0


def test_parked_requests_wait_for_the_period_their_round_told() -> None:
    b = Batcher(lambda semaphore: (1.0, PERIOD))
    key = ("s", "k")
    body = {"client_id": "c1", "demand": [{"group": None, "count": 1}]}
    blocked = {"c1": frozenset({None})}
    b.add(key, Waiting(body, None, None, 0.0))
    assert len(b.take_due(1.0)) == 1
    b.finished(key, round_at=1.0, blocked=blocked, period=3 * PERIOD)  # stretched
    b.add(key, Waiting(body, None, None, 1.01))  # a blocked client asking at once: parked
    assert b.round_at(key) == pytest.approx(1.0 + 3 * PERIOD + GATHER)
    at = 1.0 + 3 * PERIOD + GATHER
    assert len(b.take_due(at)) == 1
    b.finished(key, round_at=at, blocked=blocked)  # no longer stretched
    b.add(key, Waiting(body, None, None, at + 0.01))
    assert b.round_at(key) == pytest.approx(at + PERIOD + GATHER)


def test_an_overload_that_comes_and_goes_is_logged_once_per_log_every(
        caplog: pytest.LogCaptureFixture) -> None:
    pressure = Pressure(lambda: PERIOD)
    with caplog.at_level("INFO", logger="durability_celery.holder"):
        for now in range(0, 60, 2):  # on at even seconds, off at odd ones
            pressure._log(float(now), overloaded=True)
            pressure._log(now + 1.0, overloaded=False)
    assert caplog.text.count("durability holder: overloaded") == 2  # at 0 and 30 s
    assert caplog.text.count("no longer overloaded") == 2  # after each warning
