# Fixtures of the gate tests: a PostgreSQL database of this area's own, the
# Redis broker (DB 4) and ledger (DB 5; both shifted by DC_TEST_REDIS_DB_OFFSET),
# and a `Cluster` that starts one holder worker and any number of client workers
# as real subprocesses on one config.
from __future__ import annotations

import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import Proc, Processes, create_postgres_database, redis_db_url

BROKER_DB = 4
LEDGER_DB = 5
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def gate_database() -> Iterator[str]:
    """One PostgreSQL database for the whole area, migrated once."""
    from durability_celery.semaphore import DurabilitySemaphore

    url, drop = create_postgres_database("dc_worker")
    try:
        DurabilitySemaphore.migrate(url)
        yield url
    finally:
        drop()


_LIFECYCLE = re.compile(r"WARNING|ERROR|CRITICAL|Connected to|gate started|gate idle|re-establish")


def log_digest(log: str, *, lines: int = 40, tail: int = 3000) -> str:
    """A worker's connection and gate lifecycle (its first warnings and errors,
    reconnects, gate starts) and then the end of its log: a failure long after a
    fault shows what happened at the fault, not only the retries since."""
    seen: set[str] = set()
    events = []
    for line in log.splitlines():
        if _LIFECYCLE.search(line):
            body = line.split("] ", 1)[-1][:300]
            if body not in seen:
                seen.add(body)
                events.append(line[:400])
    return "\n".join(["[lifecycle]", *events[:lines], "[tail]", log[-tail:]])


class Cluster:
    """One config, one holder, client workers; the test publishes through `app`."""

    def __init__(self, processes: Processes, config: dict[str, Any]) -> None:
        from tests.worker.gate_app import define_tasks, make_app

        self.processes = processes
        self.config = config
        self.env = {"DC_GATE_TEST_CONFIG": json.dumps(config)}
        self.app, self.durability = make_app(config)
        self.admitted, self.plain = define_tasks(self.app, config)
        self.ledger = redis.Redis.from_url(config["ledger_url"], decode_responses=True)
        self.semaphore = self.durability.semaphore(config["semaphore"]["name"])
        self.workers: list[Proc] = []

    def start(self, *, holder: bool = True, clients: int = 2, pool: str = "threads",
              concurrency: int = 2, extra: tuple[str, ...] = (),
              holder_extra: tuple[str, ...] = ()) -> list[Proc]:
        """Spawn everything at once, then wait for each to be ready (parallel start-up).
        `extra`: arguments of every client worker; `holder_extra`: of the holder."""
        procs = []
        if holder:
            procs.append(self._spawn("holder", ("--durability-holder", "-Q", "idle.holder",
                                                "--pool=threads", "--concurrency=1",
                                                *holder_extra)))
        for _ in range(clients):
            procs.append(self._spawn("client", (f"--pool={pool}",
                                                f"--concurrency={concurrency}", *extra)))
        for proc in procs:
            proc.wait_for_log(r"\bready\.", timeout=40)
        self.workers.extend(p for p in procs if p.name == "client")
        return procs

    def _spawn(self, name: str, args: tuple[str, ...]) -> Proc:
        cmd = [sys.executable, "-m", "celery", "-A", "tests.worker.gate_app", "worker",
               "--loglevel=INFO", "--without-mingle", "--without-gossip",
               f"--hostname={name}-{secrets.token_hex(3)}@%h", *args]
        return self.processes.spawn(cmd, name=name, env=self.env, pythonpath=[HERE.parent.parent])

    def delete_queues(self) -> None:
        """Best effort: the task and holder queues this test declared (RabbitMQ keeps them)."""
        if not self.config["broker_url"].startswith("amqp"):
            return
        names = [self.config["task_queue"], *self.durability.holder_queues()]
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            for name in names:
                try:
                    channel.queue_delete(name)
                except Exception:
                    channel = connection.channel()

    # -- ledger -----------------------------------------------------------------

    def starts(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.ledger.hgetall("starts").items()}

    def ends(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.ledger.hgetall("ends").items()}

    def in_delivery(self) -> dict[str, bool]:
        """Tasks published with mode="where": whether each ran inside the callback that
        delivered its message."""
        return {k: v == "1" for k, v in self.ledger.hgetall("in_delivery").items()}

    def max_running(self, key: str, group: str | None = None) -> int:
        name = f"max:{key}" if group is None else f"max:{key}:{group}"
        return int(self.ledger.get(name) or 0)

    def wait_for(self, what: str, check: Callable[[], bool], *, timeout: float,
                 context: Callable[[], str] = str, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name} ({p.log_path}) ---\n{log_digest(p.log())}"
                                  for p in self.workers)
                pytest.fail(f"timed out waiting for {what}: {context()}\n{logs}", pytrace=False)
            time.sleep(interval)

    def publish(self, n: int, *, key: str, group: str | None = None,
                work: float = 0.2, mode: str | None = None) -> list[str]:
        kwargs: dict[str, Any] = {"account": key, "group": group, "work": work}
        if mode is not None:  # the fault tests' task takes no mode
            kwargs["mode"] = mode
        return [str(self.admitted.apply_async(kwargs=kwargs).id) for _ in range(n)]

    def drained(self, ids: list[str], key: str, *, timeout: float) -> None:
        """Wait until every task of `ids` ended and the holder's usage of `key` is back
        to zero; check that each ran exactly once."""
        self.wait_for("every task to end", lambda: set(ids) <= set(self.ends()),
                      timeout=timeout, context=lambda: str(self.inspect_held()))
        self.wait_for("holder usage back to zero", lambda: self.usage_zero(key),
                      timeout=20, context=lambda: str(self.semaphore.usage(key)))
        starts = self.starts()
        assert {starts.get(i) for i in ids} == {1}, "each ran exactly once"

    def permits_heard(self, worker: str) -> int:
        """Grant claims and lease draws of `worker` (a node name) that the holder has heard."""
        from sqlalchemy import text

        pattern = {"client": worker.replace("%", r"\%").replace("_", r"\_") + "/%"}
        with self.semaphore.engine.connect() as connection:
            return sum(int(connection.execute(text(
                f"SELECT COALESCE(SUM({column}), 0) FROM durability_semaphore_{table} "
                "WHERE client_id LIKE :client ESCAPE '\\'"), pattern).scalar_one())
                for table, column in (("grants", "claimed"), ("leases", "drawn")))

    def usage_zero(self, key: str) -> bool:
        usage = self.semaphore.usage(key)
        return usage.outstanding == 0 and usage.lease_footprint == 0

    def busy_worker(self, *, running: int = 1, timeout: float = 20) -> Proc:
        """Wait for a client worker that runs `running` admitted tasks or more and holds
        another, and whose permits the holder has heard it use; returns its process (the
        victim of the crash tests).

        Killed before its claims reach the holder, a worker's tasks die unheard of,
        and the holder rightly gives their permits out again at the claim deadline,
        while the ledger would count them as running forever."""
        victim: list[str] = []

        def one_worker_runs_and_holds() -> bool:
            for name, reply in self.inspect_held().items():
                if (name.startswith("client") and reply["running"] >= running
                        and reply["held"] >= 1
                        and self.permits_heard(name) >= reply["running"]):
                    victim[:] = [name]
                    return True
            return False

        self.wait_for("a worker running and holding tasks", one_worker_runs_and_holds,
                      timeout=timeout)
        return next(p for p in self.workers if victim[0].split("@")[0] in p.log())

    def inspect_held(self) -> dict[str, Any]:
        return self.inspect("durability_held")

    def inspect_task(self, task_id: str) -> dict[str, Any]:
        """Each worker's answer to where it has `task_id` (`durability_task`)."""
        return self.inspect("durability_task", task_id=task_id)

    def inspect(self, command: str, **arguments: Any) -> dict[str, Any]:
        # Every worker answers (the holder too): stop waiting once all have.
        replies = self.app.control.broadcast(command, arguments=arguments, reply=True,
                                             timeout=2.0, limit=len(self.processes.procs))
        merged: dict[str, Any] = {}
        for reply in replies:
            merged.update(reply)
        return merged


@pytest.fixture
def cluster_factory(processes: Processes, gate_database: str
                    ) -> Iterator[Callable[..., Cluster]]:
    broker = redis_db_url(BROKER_DB)
    ledger = redis_db_url(LEDGER_DB)
    for url in (broker, ledger):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
    made: list[Cluster] = []

    def make(*, limits: dict[str, int], group_limits: dict[str, int] | None = None,
             leases: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
             transport: dict[str, Any] | None = None, broker_url: str = broker,
             **semaphore: Any) -> Cluster:
        config = {
            "broker_url": broker_url, "ledger_url": ledger, "database": gate_database,
            # A queue of its own: RabbitMQ is shared with every other test run.
            "task_queue": f"dct.tasks.{secrets.token_hex(3)}",
            "broker_transport_options": transport or {},
            "limits": limits, "group_limits": group_limits or {},
            "semaphore": {"name": f"sem-{secrets.token_hex(4)}", "leases": leases, **semaphore},
            "settings": {"queue_prefix": f"dct{secrets.token_hex(3)}", "shards": 2,
                         "request_timeout": 3.0, **(settings or {})},
        }
        cluster = Cluster(processes, config)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        processes.stop_all()
        for cluster in made:
            cluster.semaphore.close()
            cluster.delete_queues()
