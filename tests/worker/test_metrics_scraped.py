# The metrics of real workers, scraped over HTTP: a holder and client workers
# (prefork and threads) started with --durability-metrics-port, Redis and
# PostgreSQL, tasks of two keys. After the work is done the admissions counted
# are the tasks run, the held and running gauges are back to 0, the holder
# counted its rounds and replies; a key label appears only when the settings opt
# in; prefork children do not keep the port; a port that cannot be had stops
# the worker with one line.
from __future__ import annotations

import os
import re
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import Proc, Processes

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLAG = "--durability-metrics-port"
STANDARD = ("process_", "python_")
"""The standard series of prometheus-client served next to ours."""

Samples = list[tuple[str, dict[str, str], float]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(value for sample, found, value in samples
               if sample == name and labels.items() <= found.items())


def label_sets(samples: Samples, name: str) -> set[frozenset[str]]:
    return {frozenset(found) for sample, found, _ in samples if sample == name}


def run_two_keys(cluster: Cluster, n: int, *,
                 busy: Callable[[], bool] | None = None) -> list[str]:
    """Run n tasks over keys k1 and k2; `busy`, if given, must turn true while they run."""
    ids = (cluster.publish(n // 2, key="k1", work=0.1)
           + cluster.publish(n - n // 2, key="k2", work=0.1))
    if busy is not None:
        cluster.wait_for("the workers to hold and run tasks", busy, timeout=10)
    for key in ("k1", "k2"):
        cluster.drained(ids, key, timeout=40)
    return ids


def listening_inode(port: int) -> str:
    """The socket inode of the TCP listener on `port` (Linux /proc)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def holds_socket(pid: int, inode: str) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) == f"socket:[{inode}]" for fd in fds.iterdir())


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_scraped_series_after_load(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"k1": 2, "k2": 2})
    holder_port, prefork_port, threads_port = free_port(), free_port(), free_port()
    [_, prefork] = cluster.start(clients=1, pool="prefork", concurrency=2,
                                 extra=(FLAG, str(prefork_port)),
                                 holder_extra=(FLAG, str(holder_port)))
    cluster.start(holder=False, clients=1, pool="threads", extra=(FLAG, str(threads_port)))
    n = 24
    clients = (prefork_port, threads_port)

    def busy() -> bool:
        scraped = [scrape(port) for port in clients]
        return sum(total(s, "durability_worker_running_tasks") for s in scraped) > 0 and sum(
            total(s, "durability_worker_held_tasks") for s in scraped) > 0

    run_two_keys(cluster, n, busy=busy)

    def settled() -> bool:
        scraped = [scrape(port) for port in clients]
        return (sum(total(s, "durability_worker_admissions_total") for s in scraped) == n
                and all(total(s, "durability_worker_running_tasks") == 0 for s in scraped))

    cluster.wait_for("the admissions to add up", settled, timeout=10,
                     context=lambda: str([scrape(port) for port in clients]))
    name = cluster.config["semaphore"]["name"]
    for port in clients:
        samples = scrape(port)
        assert {s for _, labels, _ in samples if (s := labels.get("source"))} <= {
            "grant", "lease", "handoff"}
        assert total(samples, "durability_worker_hold_seconds_count") == total(
            samples, "durability_worker_admissions_total")
        assert total(samples, "durability_worker_held_tasks", semaphore=name) == 0
        assert label_sets(samples, "durability_worker_held_tasks") == {frozenset({"semaphore"})}
        assert label_sets(samples, "durability_worker_admissions_total") == {
            frozenset({"semaphore", "source"})}
    holder = scrape(holder_port)
    assert total(holder, "durability_holder_rounds_total", semaphore=name) > 0
    assert label_sets(holder, "durability_holder_rounds_total") == {frozenset({"semaphore"})}
    assert total(holder, "durability_holder_replies_total", status="ok") > 0
    assert total(holder, "durability_holder_round_duration_seconds_count", semaphore=name) > 0
    assert total(holder, "durability_holder_batch_keys_sum", semaphore=name) == total(
        holder, "durability_holder_rounds_total")
    assert total(holder, "durability_holder_overloaded") == 0
    assert total(holder, "durability_holder_errors_total") == 0
    for samples in (holder, *(scrape(port) for port in clients)):
        assert all(s.startswith(("durability_", *STANDARD)) for s, _, _ in samples)
        assert total(samples, "process_resident_memory_bytes") > 0
    # The pool's children have no server thread, nor the server's socket.
    inode = listening_inode(prefork_port)
    assert holds_socket(prefork.pid, inode)
    pool = children(prefork.pid)
    assert pool, "the prefork worker has pool processes"
    assert not [pid for pid in pool if holds_socket(pid, inode)]


def test_key_labels_only_when_opted_in(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"k1": 1, "k2": 1},
                              settings={"metrics_key_labels": True})
    holder_port, client_port = free_port(), free_port()
    cluster.start(clients=1, extra=(FLAG, str(client_port)),
                  holder_extra=(FLAG, str(holder_port)))
    run_two_keys(cluster, 6)
    client, holder = scrape(client_port), scrape(holder_port)
    assert {labels["key"] for s, labels, _ in client
            if s == "durability_worker_admissions_total"} == {"k1", "k2"}
    assert total(client, "durability_worker_admissions_total") == 6
    assert {labels["key"] for s, labels, _ in holder
            if s == "durability_holder_rounds_total"} == {"k1", "k2"}
    # Histograms never carry a key, whatever the settings.
    assert label_sets(client, "durability_worker_hold_seconds_count") == {
        frozenset({"semaphore"})}


def start_refused(processes: Processes, cluster: Cluster, port: str) -> Proc:
    proc = cluster._spawn("holder", ("--durability-holder", "--pool=threads", FLAG, port))
    assert proc.popen.wait(timeout=30) != 0
    return proc


def test_port_that_cannot_be_had_stops_the_worker(
        cluster_factory: Callable[..., Cluster], processes: Processes) -> None:
    cluster = cluster_factory(limits={"k1": 1})
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = start_refused(processes, cluster, str(port)).log()
    assert re.search(rf"^Error: {FLAG} {port}: cannot serve metrics on that port: "
                     r"Address already in use$", log, re.MULTILINE), log
    assert "Traceback" not in log
    assert "durability holder: starting" not in log and "ready." not in log
    log = start_refused(processes, cluster, "70000").log()
    assert f"Invalid value for '{FLAG}'" in log and "Traceback" not in log
