# DurabilitySettings and Durability(app, ...) refuse what they cannot use, naming it.
from __future__ import annotations

from typing import Any

import pytest

from durability_celery import Durability, DurabilitySettings, durability_for
from durability_celery.errors import ConfigurationError


@pytest.mark.parametrize(("options", "message"), [
    ({"max_held": 2.5}, "max_held must be an int, got 2.5"),
    ({"round_threads": 2.0}, "round_threads must be an int, got 2.0"),
    ({"shards": True}, "shards must be an int, got True"),
    ({"shards": 0}, "shards must be between 1 and 4096, got 0"),
    ({"request_timeout": float("nan")}, "request_timeout must be between"),
])
def test_bad_settings_are_refused_naming_the_setting(options: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{message}"):
        DurabilitySettings(**options)


@pytest.mark.parametrize("app", [None, "app", 5])
def test_only_a_celery_app_takes_or_has_a_configuration(app: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^app must be a Celery app"):
        Durability(app, [])
    with pytest.raises(ConfigurationError, match="has no Durability configuration"):
        durability_for(app)
