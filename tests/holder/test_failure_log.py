# How the holder's log names a failed round: a missing schema says what to run.
from __future__ import annotations

import pytest

from durability_celery.errors import InfrastructureError, SchemaMissing
from durability_celery.holder.outcomes import log_failure as _log_failure


@pytest.mark.parametrize(("exc", "said", "not_said"), [
    (SchemaMissing("the database has no durability schema: run `durability-celery migrate`"),
     "durability-celery migrate", "database unavailable"),
    (InfrastructureError("connection refused"), "database unavailable", "migrate"),
])
def test_a_failed_round_is_one_line_saying_why(exc: Exception, said: str, not_said: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("ERROR", logger="durability_celery.holder"):
        _log_failure("round", ("jobs", "acct-1"), exc)
    (record,) = caplog.records
    assert said in record.getMessage() and not_said not in record.getMessage()
    assert record.exc_info is None
