# The hold deadline a worker uses: the configured one, else half the broker's
# redelivery limit (Redis's visibility_timeout), at most 15 minutes. A configured
# one that Redis would overtake is kept, with a warning. Pure: a Celery app's
# configuration, no broker.
from __future__ import annotations

import logging

import pytest
from celery import Celery

from durability_celery.worker.step import hold_deadline


def app(**transport: float) -> Celery:
    return Celery("hold", broker_transport_options=transport, set_as_current=False)


@pytest.mark.parametrize(("driver", "transport", "expected"), [
    ("redis", {}, 900.0),  # visibility 1 h: capped at 15 min
    ("redis", {"visibility_timeout": 60}, 30.0),
    ("redis", {"visibility_timeout": 1}, 1.0),  # never below a second
    ("amqp", {"visibility_timeout": 60}, 900.0),  # not Redis: its option means nothing
])
def test_the_default_follows_the_broker(driver: str, transport: dict[str, float],
                                        expected: float) -> None:
    assert hold_deadline(app(**transport), driver, None) == expected


def test_a_configured_deadline_redis_would_overtake_is_kept_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="durability_celery.worker"):
        assert hold_deadline(app(visibility_timeout=60), "redis", 30) == 30
        assert not caplog.records
        assert hold_deadline(app(visibility_timeout=60), "redis", 60) == 60
    (record,) = caplog.records
    assert "not below the Redis visibility_timeout 60s" in record.getMessage()
