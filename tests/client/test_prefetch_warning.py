# The worker says at start-up when its prefetch settings work against the gate.
from __future__ import annotations

import pytest

from durability_celery.worker.step import warn_about_prefetch


@pytest.mark.parametrize(("conf", "said"), [
    ({"worker_prefetch_multiplier": 1}, []),
    ({"worker_prefetch_multiplier": 4}, ["worker_prefetch_multiplier is 4"]),
    ({"worker_prefetch_multiplier": 1, "worker_disable_prefetch": True},
     ["worker_disable_prefetch is set"]),
])
def test_prefetch_settings_the_gate_needs(conf: dict[str, object], said: list[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="durability_celery.worker"):
        warn_about_prefetch(conf)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(said)
    for text, expected in zip(messages, said, strict=True):
        assert expected in text
