# The Prometheus series of the holder and of the client gate (docs/operations.md,
# "Metrics"), in a registry of each process's own, and the HTTP server that
# serves it. Rules: nothing here imports Celery (the bootsteps wire it in); a
# `key` label only where DurabilitySettings.metrics_key_labels opts in, since
# keys may be countless and every key would be a series; histograms never
# carry a key.
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    start_http_server,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

ROUND_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_KEYS = (1, 2, 5, 10, 25, 50, 100, 200)
"""Up to the dispatcher's MAX_BATCH: its most keys in one transaction."""
HOLD_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0, 900.0)
"""From a permit at hand (no wait) through a round or two (1-3 s) to the hold deadline."""

Occupancy = Callable[[], Iterable[tuple[str, str, int, int]]]
"""(semaphore, key, held, running) of each key a worker holds or runs tasks of."""


class HolderMetrics:
    """What a holder counts: its rounds, their batches, its replies, errors and load."""

    def __init__(self, registry: CollectorRegistry, *, key_labels: bool) -> None:
        self.key_labels = key_labels
        self.rounds = Counter(
            "durability_holder_rounds", "Rounds run and committed, one per key per batch.",
            ["semaphore", "key"] if key_labels else ["semaphore"], registry=registry)
        self.round_seconds = Histogram(
            "durability_holder_round_duration_seconds",
            "Seconds one batch of rounds took (one transaction, all its keys).",
            ["semaphore"], buckets=ROUND_SECONDS, registry=registry)
        self.batch_keys = Histogram(
            "durability_holder_batch_keys", "Keys whose rounds ran in one transaction.",
            ["semaphore"], buckets=BATCH_KEYS, registry=registry)
        self.replies = Counter(
            "durability_holder_replies",
            "Replies sent to clients, by status: ok, or the error code the client got.",
            ["status"], registry=registry)
        self.errors = Counter(
            "durability_holder_errors",
            "Failed jobs (round: per key; reclaim; scan: the deadline scan).",
            ["semaphore", "job"], registry=registry)
        self._load = (0.0, 0, False)
        registry.register(_Collected(self._collect_load))

    def batch(self, semaphore: str, keys: Sequence[str], seconds: float,
              results: Sequence[object] | None) -> None:
        """A batch of rounds over `keys` ran for `seconds`; `results` per key (an exception
        for a round that failed alone), None when the whole batch failed."""
        self.round_seconds.labels(semaphore).observe(seconds)
        self.batch_keys.labels(semaphore).observe(len(keys))
        failed = len(keys) if results is None else 0
        for key, result in zip(keys, results or (), strict=False):
            if isinstance(result, Exception):
                failed += 1
            elif self.key_labels:
                self.rounds.labels(semaphore, key).inc()
        if not self.key_labels:
            self.rounds.labels(semaphore).inc(len(keys) - failed)
        if failed:
            self.errors.labels(semaphore, "round").inc(failed)

    def reply(self, body: Mapping[str, Any]) -> None:
        error = body.get("error")
        status = error.get("code") if isinstance(error, dict) else "ok"
        self.replies.labels(str(status)).inc()

    def load(self, lag: float, waiting: int, overloaded: bool) -> None:
        """The dispatcher's last look at its load (Dispatcher._check_overload, Pressure)."""
        self._load = (lag, waiting, overloaded)

    def _collect_load(self) -> Iterable[Metric]:
        lag, waiting, overloaded = self._load
        yield GaugeMetricFamily(
            "durability_holder_overloaded",
            "1 while the holder is overloaded (holder/pressure.py): periods stretched, or "
            "requests waiting more than OVERLOAD_LAG.",
            value=float(overloaded))
        yield GaugeMetricFamily(
            "durability_holder_round_lag_seconds",
            "The longest recent wait of requests: for a round thread, in a round batch, "
            "in the shard queues.",
            value=max(0.0, lag))
        yield GaugeMetricFamily(
            "durability_holder_waiting_requests", "Requests waiting for their key's round.",
            value=waiting)


class WorkerMetrics:
    """What a client worker's gate counts: its admissions, hold times, held and running
    tasks, and keys whose holder did not answer."""

    def __init__(self, registry: CollectorRegistry, *, key_labels: bool) -> None:
        self.key_labels = key_labels
        per_key = ["semaphore", "key"] if key_labels else ["semaphore"]
        self.admissions = Counter(
            "durability_worker_admissions",
            "Admitted tasks by where their permit came from: grant, lease or handoff.",
            [*per_key, "source"], registry=registry)
        self.hold_seconds = Histogram(
            "durability_worker_hold_seconds",
            "Seconds from a task's arrival at the gate to its admission (0: a permit was "
            "at hand).", ["semaphore"], buckets=HOLD_SECONDS, registry=registry)
        self.unanswered = Counter(
            "durability_worker_unanswered",
            "Times a key's requests went unanswered by its holder while its tasks waited.",
            per_key, registry=registry)
        self._occupancy: Occupancy = tuple
        self._semaphores: tuple[str, ...] = ()
        registry.register(_Collected(self._collect_occupancy))

    def admitted(self, semaphore: str, key: str, source: str, held: float) -> None:
        """A task of (semaphore, key) was admitted on a `source` permit after `held` s."""
        if self.key_labels:
            self.admissions.labels(semaphore, key, source).inc()
        else:
            self.admissions.labels(semaphore, source).inc()
        self.hold_seconds.labels(semaphore).observe(held)

    def no_answer(self, semaphore: str, key: str) -> None:
        if self.key_labels:
            self.unanswered.labels(semaphore, key).inc()
        else:
            self.unanswered.labels(semaphore).inc()

    def watch(self, occupancy: Occupancy, semaphores: Iterable[str]) -> None:
        """Read held and running tasks from `occupancy` at each scrape; without key labels
        every one of `semaphores` has a sample, 0 when idle."""
        self._occupancy = occupancy
        self._semaphores = tuple(semaphores)

    def _collect_occupancy(self) -> Iterable[Metric]:
        labels = ["semaphore", "key"] if self.key_labels else ["semaphore"]
        held = GaugeMetricFamily("durability_worker_held_tasks",
                                 "Admitted-type tasks held at the gate, waiting for a permit.",
                                 labels=labels)
        running = GaugeMetricFamily("durability_worker_running_tasks",
                                    "Admitted tasks running (their permit not yet released).",
                                    labels=labels)
        totals: dict[tuple[str, ...], list[int]] = {}
        if not self.key_labels:
            totals = {(name,): [0, 0] for name in self._semaphores}
        for semaphore, key, held_count, running_count in self._occupancy():
            where: tuple[str, ...] = (semaphore, key) if self.key_labels else (semaphore,)
            counts = totals.setdefault(where, [0, 0])
            counts[0] += held_count
            counts[1] += running_count
        for where, (held_count, running_count) in sorted(totals.items()):
            held.add_metric(where, held_count)
            running.add_metric(where, running_count)
        yield held
        yield running


class Metrics:
    """The durability_* series of one process (a holder, a client worker, or both) and
    the standard process and Python series, in a registry of their own: a process that
    serves no metrics, or a test that builds several, never touches the global one."""

    def __init__(self, *, key_labels: bool = False) -> None:
        self.key_labels = key_labels
        self.registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self._lock = threading.Lock()
        self._holder: HolderMetrics | None = None
        self._worker: WorkerMetrics | None = None
        self.server: Any = None

    def holder(self) -> HolderMetrics:
        with self._lock:
            if self._holder is None:
                self._holder = HolderMetrics(self.registry, key_labels=self.key_labels)
            return self._holder

    def worker(self) -> WorkerMetrics:
        with self._lock:
            if self._worker is None:
                self._worker = WorkerMetrics(self.registry, key_labels=self.key_labels)
            return self._worker

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on `port` from a daemon thread (OSError: cannot listen there).

        A forked child (a prefork pool's process) closes its copy of the listening
        socket at once: it has no server thread, and its copy would keep the port taken
        after the worker itself is gone."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        self.server = server
        _SERVERS.add(server)

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def served_by(worker: Any) -> Metrics | None:
    """The metrics a Celery worker serves (None: started without --durability-metrics-port;
    its MetricsStep sets them while the worker is built, before any step starts)."""
    return getattr(worker, "durability_metrics", None)


class _Collected:
    """A collector whose samples a function makes at each scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self.collect = collect


_SERVERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_SERVERS):
        server.socket.close()
    _SERVERS.clear()


if hasattr(os, "register_at_fork"):  # POSIX only; elsewhere nothing forks a worker's pool
    os.register_at_fork(after_in_child=_close_in_child)
