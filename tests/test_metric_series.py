# The metric series themselves, without Celery: what a batch of rounds, a reply,
# a failed reclaim or scan and the gate's occupancy read as; a `key` label only
# when opted in; one registry per Metrics, so two never collide. The holder's
# store calls are counted on a real semaphore over SQLite.
from __future__ import annotations

from pathlib import Path

import pytest

from durability_celery.errors import ConfigurationError, InfrastructureError
from durability_celery.holder.service import Counted
from durability_celery.metrics import Metrics
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings

pytestmark = pytest.mark.timeout(30)


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_batch_counts_its_committed_rounds_and_failed_ones_as_errors() -> None:
    metrics = Metrics()
    holder = metrics.holder()
    holder.batch("s", ["a", "b", "c"], 0.02, [[{}], ValueError("bad"), [{}]])
    holder.batch("s", ["d", "e"], 0.5, None)  # the whole batch failed
    assert value(metrics, "durability_holder_rounds_total", semaphore="s") == 2
    assert value(metrics, "durability_holder_errors_total", semaphore="s", job="round") == 3
    assert value(metrics, "durability_holder_round_duration_seconds_count", semaphore="s") == 2
    assert value(metrics, "durability_holder_batch_keys_sum", semaphore="s") == 5


def test_replies_count_by_status() -> None:
    metrics = Metrics()
    holder = metrics.holder()
    holder.reply({"v": 1, "round_at": 1.0, "grants": []})
    holder.reply({"v": 1, "error": {"code": "invalid_message", "message": "no"}})
    assert value(metrics, "durability_holder_replies_total", status="ok") == 1
    assert value(metrics, "durability_holder_replies_total", status="invalid_message") == 1


def test_load_is_read_at_each_scrape() -> None:
    metrics = Metrics()
    metrics.holder().load(2.5, 700, True)
    assert value(metrics, "durability_holder_overloaded") == 1
    assert value(metrics, "durability_holder_round_lag_seconds") == 2.5
    assert value(metrics, "durability_holder_waiting_requests") == 700


def test_a_key_label_only_when_opted_in() -> None:
    plain, keyed = Metrics(), Metrics(key_labels=True)
    for metrics in (plain, keyed):
        metrics.holder().batch("s", ["a"], 0.01, [[{}]])
        metrics.worker().admitted("s", "a", "lease", 1.5)
        metrics.worker().no_answer("s", "a")
    assert value(plain, "durability_worker_admissions_total", semaphore="s", source="lease") == 1
    assert value(keyed, "durability_worker_admissions_total", semaphore="s", key="a",
                 source="lease") == 1
    assert value(plain, "durability_holder_rounds_total", semaphore="s") == 1
    assert value(keyed, "durability_holder_rounds_total", semaphore="s", key="a") == 1
    assert value(keyed, "durability_worker_unanswered_total", semaphore="s", key="a") == 1
    # Histograms never carry a key.
    assert value(keyed, "durability_worker_hold_seconds_sum", semaphore="s") == 1.5


def test_held_and_running_are_read_from_the_gate_at_each_scrape() -> None:
    rows = [("s", "a", 2, 1), ("s", "b", 0, 3)]
    plain, keyed = Metrics(), Metrics(key_labels=True)
    for metrics in (plain, keyed):
        metrics.worker().watch(lambda: rows, ["s", "idle"])
    assert value(plain, "durability_worker_held_tasks", semaphore="s") == 2
    assert value(plain, "durability_worker_running_tasks", semaphore="s") == 4
    assert value(plain, "durability_worker_held_tasks", semaphore="idle") == 0
    assert value(keyed, "durability_worker_running_tasks", semaphore="s", key="b") == 3
    assert value(keyed, "durability_worker_held_tasks", semaphore="idle") is None
    rows.clear()
    assert value(plain, "durability_worker_running_tasks", semaphore="s") == 0


def test_the_store_calls_of_a_holder_are_counted(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}"
    DurabilitySemaphore.migrate(url)
    semaphore = DurabilitySemaphore("s", database=url, limit=1)
    metrics = Metrics()
    counted = Counted(semaphore, metrics.holder())
    try:
        results = counted.run_rounds([("a", [{"v": 1, "client_id": "c", "demand": []}]),
                                      ("", [])])
        assert isinstance(results[1], Exception)  # an empty key: that round alone fails
        assert value(metrics, "durability_holder_rounds_total", semaphore="s") == 1
        assert value(metrics, "durability_holder_errors_total", semaphore="s",
                     job="round") == 1
        assert counted.config is semaphore.config  # the rest is the semaphore's own
        semaphore.engine.dispose()
        (tmp_path / "d.db").unlink()  # reclaims and scans now fail
        (tmp_path / "d.db").mkdir()
        for call in (lambda: counted.reclaim("a"), counted.deadlines):
            with pytest.raises(InfrastructureError):
                call()
        assert value(metrics, "durability_holder_errors_total", semaphore="s",
                     job="reclaim") == 1
        assert value(metrics, "durability_holder_errors_total", semaphore="s", job="scan") == 1
    finally:
        semaphore.close()


def test_metrics_key_labels_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="metrics_key_labels must be a bool"):
        DurabilitySettings(metrics_key_labels="yes")  # type: ignore[arg-type]
